"""Time training steps of several implementations on the same toy model, interleaved, and compare medians.

Used by notebook 05 (compare_step_times: naive, bucketed and torch DDP), and by the benches of every
chapter that races two implementations (paired_ratios, training_step, print_ratios: 07, 08, 10, 11,
12): here, below the topics, so that no chapter's bench imports another's.

The variants run interleaved in one run (dpcourse.runtime.timing says why).

A variant is a factory `make(module) -> (model, sync)`: `model(x)` runs forward,
and `sync()` (or None) is what the training loop calls between backward and the
optimizer step -- e.g. `(module, lambda: average_gradients(module))` for naive DDP,
`(ddp, ddp.finish_gradient_sync)` with `ddp = BucketedDDP(module)`, and
`(DistributedDataParallel(module), None)` for torch's DDP, which finishes inside backward.
A third element, if present, wraps the optimizer (Horovod's design:
`(module, None, DistributedOptimizer)`).
"""

import statistics

import torch
import torch.distributed as dist

from dpcourse.backend import rank_device
from dpcourse.runtime.launcher import launch
from dpcourse.runtime.timing import interleaved_step_times
from dpcourse.toys.data import my_share, smooth_regression_data
from dpcourse.toys.models import deep_mlp, loss_fn


def step_times(variants, depth=6, width=256, per_rank=32, steps=3, rounds=4, dtype=torch.float32):
    """Inside a rank: time `rounds` x `steps` training steps of every variant, round-robin.

    Returns {name: [seconds per step, ...]} without the first round (warm-up).
    Every step starts after a barrier, so each rank times the same step.
    """
    device = rank_device()
    X, Y = smooth_regression_data(per_rank * dist.get_world_size(), features=width, outputs=width, seed=1,
                                  dtype=dtype)
    x, y = my_share(X, Y, 0, per_rank, device=device)
    built = {}
    for name, make in variants.items():
        module = deep_mlp(depth, width, d_in=width, d_out=width, seed=0, dtype=dtype, device=device)
        model, sync, *wrap = make(module)
        opt = torch.optim.SGD(module.parameters(), lr=1e-3)
        built[name] = (model, sync, wrap[0](opt) if wrap and wrap[0] is not None else opt)
    return interleaved_step_times({name: training_step(*built[name], x, y) for name in built}, rounds, steps)


def training_step(model, sync, opt, x, y):
    """One plain training step of a variant (its sync, if any, between backward and the optimizer)."""
    def step():
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        if sync is not None:
            sync()
        opt.step()
    return step


def compare_step_times(variants, world_size, baseline=None, **options):
    """Launch `world_size` ranks running `step_times`; return {name: median seconds per step on rank 0}.

    With `baseline` (a variant's name), return (medians, ratios) where ratios[name] is the median over
    rounds of this round's median step time / the baseline's in the same round: pairing each round
    with itself cancels the drift of a shared machine better than a ratio of overall medians.
    """
    deadline = options.pop("deadline", 300)
    steps = options.get("steps", 3)
    results = launch(step_times, world_size, variants, deadline=deadline, **options)
    medians = {name: statistics.median(times) for name, times in results[0].items()}
    if baseline is None:
        return medians
    return medians, paired_ratios(results[0], baseline, steps)


def paired_ratios(times, baseline, steps):
    """{name: median over rounds of median(name's steps) / median(baseline's steps) in that round}."""
    def per_round(values):
        return [statistics.median(values[i:i + steps]) for i in range(0, len(values), steps)]
    base = per_round(times[baseline])
    return {name: statistics.median(a / b for a, b in zip(per_round(values), base, strict=True))
            for name, values in times.items()}


def print_ratios(medians_by_world_size, baseline, ratios_by_world_size=None):
    """A table: median step time of each variant and its ratio to `baseline`, per world size.

    The ratio is medians[name] / medians[baseline], or the paired ratio when ratios are given.
    """
    names = list(next(iter(medians_by_world_size.values())))
    print(f"{'N':>3}  " + "  ".join(f"{name:>22}" for name in names))
    for world_size, medians in medians_by_world_size.items():
        ratios = (ratios_by_world_size or {}).get(world_size) or {
            n: medians[n] / medians[baseline] for n in names}
        cells = [f"{medians[n] * 1e3:8.1f} ms ({ratios[n]:4.2f}x)" for n in names]
        print(f"{world_size:>3}  " + "  ".join(f"{c:>22}" for c in cells))
    how = "median over rounds of per-round ratios" if ratios_by_world_size else "ratio of medians"
    print(f"(step time / step time of {baseline}: {how}, same run)")
