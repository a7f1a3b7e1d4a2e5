"""Step time of DDP with a PowerSGD hook -- yours, or the course's -- against torch's powerSGD_hook.

    medians, ratios = compare_hooks({"yours": (powersgd_hook, PowerSGDState)}, world_size=2)

Why a module: notebook 11's demo and `make bench` (tests/bench/bench_powersgd.py) time the same
thing: a square MLP (width x width matrices, float32) under torch's DistributedDataParallel, with
no hook, with torch's `powerSGD_hook` and with a hook of the same contract as the exercise's, all
interleaved in one launch (dpcourse.toys.bench: round-robin, a barrier before every step,
per-round ratios). torch's state is configured to do what the exercise does -- compress from the
third step (`start_powerSGD_iter=2`, the least torch accepts with error feedback), every matrix
whose factors are smaller (`min_compression_rate=1`), error feedback and warm start on -- so the
two hooks send the same bytes and the ratio of their step times compares implementations.

One bucket for every variant (`bucket_cap_mb` large; an explicit cap also sets the first bucket's):
with several buckets on gloo, torch's powerSGD_hook issues the P and Q all-reduces of different buckets
from `.then` callbacks, on whatever thread completed the previous all-reduce, so the ranks can issue them
in different orders. Measured here (2 ranks, a 256-wide MLP of 4 layers, bucket_cap_mb=0.3, 5 steps):
3 runs of 3 hung or aborted in gloo ("Received data size doesn't match expected size"), while a hook
that issues every collective from backward's thread, in bucket order, ran.
"""

from dpcourse.backend import rank_device
from dpcourse.toys.bench import compare_step_times

ONE_BUCKET_MB = 1024  # every gradient in one bucket (see the module docstring)


def _ddp(module):
    from torch.nn.parallel import DistributedDataParallel

    device = rank_device()
    return DistributedDataParallel(module, device_ids=[device] if device.type == "cuda" else None,
                                   bucket_cap_mb=ONE_BUCKET_MB)


def torch_state(matrix_rank):
    """torch's PowerSGDState configured as the exercise's hook works (see the module docstring)."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    return PowerSGDState(process_group=None, matrix_approximation_rank=matrix_rank, start_powerSGD_iter=2,
                         min_compression_rate=1, use_error_feedback=True, warm_start=True)


def torch_hook():
    """(torch's powerSGD_hook, torch_state): a (hook, State) pair like the exercise's, for curves."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    return powerSGD_hook, torch_state


def torch_powersgd(matrix_rank):
    """A variant factory: DDP with torch's powerSGD_hook, configured as the exercise's hook."""
    return hook_variant(*torch_hook(), matrix_rank)


def hook_variant(hook, State, matrix_rank):
    """A variant factory: DDP with `hook` registered, state State(matrix_rank)."""
    def make(module):
        ddp = _ddp(module)
        ddp.register_comm_hook(State(matrix_rank), hook)
        return ddp, None
    return make


def plain_ddp(module):
    return _ddp(module), None


def compare_hooks(hooks, world_size=2, matrix_rank=4, baseline="torch powerSGD_hook", **options):
    """Median step time of DDP without a hook, with each of `hooks` ({label: (hook, State)}) and with
    torch's powerSGD_hook; returns (medians, paired ratios to `baseline`) as ddp.bench does."""
    variants = {"DDP, no hook": plain_ddp}
    for label, (hook, State) in hooks.items():
        variants[label] = hook_variant(hook, State, matrix_rank)
    variants["torch powerSGD_hook"] = torch_powersgd(matrix_rank)
    options.setdefault("depth", 4)
    options.setdefault("width", 512)
    options.setdefault("steps", 3)
    options.setdefault("rounds", 4)
    return compare_step_times(variants, world_size, baseline=baseline, **options)
