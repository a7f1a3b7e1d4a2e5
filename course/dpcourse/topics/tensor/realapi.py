"""torch's own tensor parallelism on the course's modules: `parallelize_module` with ColwiseParallel
and RowwiseParallel on a DeviceMesh, next to a learner's layers.

    rows = launch(side_by_side, 2, TensorParallelMLP, ("mlp", dict(d_model=8, d_hidden=32, seed=0)), x, dy)
    print_side_by_side(rows[0])      # each one's collectives forward and backward, and its error

Where torch puts the communication (torch/distributed/tensor/parallel/style.py, 2.13):
  * ColwiseParallel._prepare_input_fn wraps the input as `DTensor.from_local(x, mesh,
    [Replicate()])`: nothing happens forward; the gradient reaching it is Partial (each rank's
    slice of W contributes a part), and _FromTorchTensor.backward redistributes it to
    Replicate: an all-reduce. That is Megatron's f.
  * RowwiseParallel._prepare_output_fn calls `outputs.redistribute(placements=[Replicate()])`
    on the Partial output of the sharded matmul: an all-reduce forward (g); its backward turns
    the replicated gradient into the Partial input's gradient without communication.
  * Both shard the parameters with `distribute_tensor(param, mesh, [Shard(d)],
    src_data_rank=0)`: rank 0's full weight is scattered at set-up (weight rows for Colwise,
    columns for Rowwise; RowwiseParallel replicates the bias), so the ranks need not have
    built the same weights.
Its collectives are functional ones (`_c10d_functional::all_reduce`), which the course's
recorder counts under the same names as yours. Used by notebook 08 (the real API next to
yours) and by the benchmark tests/bench/bench_tensor_parallel.py.
"""

import copy
import logging
import warnings
from contextlib import contextmanager

import torch.distributed as dist

from dpcourse.backend import rank_device
from dpcourse.comm.cases import make_groups
from dpcourse.comm.recorder import CommRecorder
from dpcourse.topics.tensor.runs import BUILDERS


@contextmanager
def quiet_dtensor():
    """Silence what DTensor is known to print in some set-ups (FINDINGS.md: a UserWarning and a
    redistribute log line when FSDP2 is combined with tensor parallelism), on purpose and only here."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed")
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
        logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            logger.setLevel(level)


def tp_mesh(group=None):
    """A 1-D DeviceMesh over a process group (the whole world when None), on this rank's device."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group if group is not None else dist.group.WORLD, rank_device().type)


def parallelize_mlp(mlp, mesh):
    """A copy of the MLP with fc1 ColwiseParallel and fc2 RowwiseParallel (torch's API)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    with quiet_dtensor():
        plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
        return parallelize_module(copy.deepcopy(mlp), mesh, plan)


def parallelize_attention(attention, mesh):
    """A copy of the self-attention split by heads with torch's API. Its forward reshapes qkv's
    output by `n_heads`, so the copy is told how many heads each rank now computes."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    local = copy.deepcopy(attention)
    local.n_heads = attention.n_heads // mesh.size()
    with quiet_dtensor():
        return parallelize_module(local, mesh, {"qkv": ColwiseParallel(), "proj": RowwiseParallel()})


PARALLELIZE = {"mlp": parallelize_mlp, "attention": parallelize_attention}


def local_parameters(module):
    """{name: this rank's slice}: DTensor parameters as their local tensors, others as they are."""
    out = {}
    for name, p in module.named_parameters():
        value = p.to_local() if hasattr(p, "to_local") else p
        out[name] = value.detach().cpu().clone()
    return out


def _one_pass(module, x, dy):
    x = x.clone().requires_grad_()
    with CommRecorder() as forward:
        y = module(x)
        y = y + 0  # wait for an AsyncCollectiveTensor inside the recorder
    with CommRecorder() as backward:
        y.backward(dy)
    return y.detach().cpu(), x.grad.detach().cpu(), forward.ops, backward.ops


def side_by_side(learner_cls, full, x, dy, groups=None):
    """Inside a rank: the learner's module and torch's parallelize_module on the same unsharded
    module, input and output gradient. Returns {name: (output, input grad, forward ops, backward
    ops, set-up ops)}."""
    group, _ = make_groups(groups)
    kind, kwargs = full
    module = BUILDERS[kind](**kwargs)
    device = rank_device()
    x, dy = x.to(device), dy.to(device)
    rows = {}
    with CommRecorder() as setup:
        mine = learner_cls(module, group)
    rows["yours"] = (*_one_pass(mine, x, dy), setup.ops)
    with quiet_dtensor():
        with CommRecorder() as setup:
            theirs = PARALLELIZE[kind](module, tp_mesh(group))
        rows["parallelize_module"] = (*_one_pass(theirs, x, dy), setup.ops)
    return rows


def print_side_by_side(rows, reference=None):
    """A table: each implementation's collectives per direction, and its largest error against the
    unsharded module's output and input gradient (reference = (output, input grad))."""
    print(f"{'':>18} {'set-up':>38} {'forward':>22} {'backward':>22}  largest error (y, x.grad)")
    for name, (y, x_grad, forward, backward, setup) in rows.items():
        cells = [_summary(ops) for ops in (setup, forward, backward)]
        error = ""
        if reference is not None:
            error = (f"{(y.double() - reference[0].double()).abs().max().item():.1e}, "
                     f"{(x_grad.double() - reference[1].double()).abs().max().item():.1e}")
        columns = " ".join(f"{c:>{w}}" for c, w in zip(cells, (38, 22, 22), strict=True))
        print(f"{name:>18} {columns}  {error}")


def _summary(ops):
    if not ops:
        return "-"
    counts = {}
    for o in ops:
        n, b = counts.get(o.op, (0, 0))
        counts[o.op] = (n + 1, b + o.nbytes)
    return ", ".join(f"{n} {op} ({b} B)" for op, (n, b) in counts.items())


def as_reference(full, x, dy):
    """(output, input gradient) of the unsharded module in one process, float64."""
    kind, kwargs = full
    module = BUILDERS[kind](**dict(kwargs, device="cpu"))
    x = x.double().clone().requires_grad_()
    y = module(x)
    y.backward(dy.double())
    return y.detach(), x.grad
