"""Time training steps of ZeRO implementations side by side, interleaved, on the same model and data.

    step_times_of({"yours": make_a, "torch": make_b}, ...)   # inside a rank
    compare_zero_steps(variants, world_size=2, baseline="torch")

A variant is a factory `make(module) -> (model, sync, optimizer)`: a step is
`optimizer.zero_grad(); loss_fn(model(x), y).backward(); sync(); optimizer.step()` (sync may
be None). ZeRO-1 variants average gradients in `sync` (DDP's job) and shard the optimizer;
ZeRO-3 variants wrap the module and need no sync. Used by notebook 10's speed demo and by
tests/bench/bench_zero.py. Like dpcourse.toys.bench (whose paired ratios it reuses),
the variants run round-robin with the order rotated every round and a barrier before each
step, so a shared machine's drift hits them alike.
"""

import statistics

import torch
import torch.distributed as dist

from dpcourse.backend import rank_device
from dpcourse.runtime.launcher import launch
from dpcourse.runtime.timing import interleaved_step_times
from dpcourse.toys.bench import paired_ratios, training_step
from dpcourse.toys.data import my_share, smooth_regression_data
from dpcourse.toys.models import deep_mlp


def step_times_of(variants, depth=4, width=256, per_rank=32, steps=3, rounds=4, dtype=torch.float32):
    """Inside a rank: {name: [seconds per step]} over `rounds` x `steps` steps, first round dropped."""
    device = rank_device()
    X, Y = smooth_regression_data(per_rank * dist.get_world_size(), features=width, outputs=width, seed=1,
                                  dtype=dtype)
    x, y = my_share(X, Y, 0, per_rank, device=device)
    built = {name: make(deep_mlp(depth, width, d_in=width, d_out=width, seed=0, dtype=dtype, device=device))
             for name, make in variants.items()}
    return interleaved_step_times({name: training_step(*built[name], x, y) for name in built}, rounds, steps)


def compare_zero_steps(variants, world_size, pairs, deadline=300, **options):
    """Launch `world_size` ranks running step_times_of; return ({name: median seconds per step},
    {name: paired ratio to its baseline}) measured on rank 0, for pairs = {name: baseline name}."""
    steps = options.get("steps", 3)
    times = launch(step_times_of, world_size, variants, deadline=deadline, **options)[0]
    medians = {name: statistics.median(values) for name, values in times.items()}
    return medians, {name: paired_ratios(times, base, steps)[name] for name, base in pairs.items()}
