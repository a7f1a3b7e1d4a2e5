"""Time training steps of several DDP implementations on the same model, interleaved, and compare medians.

Why interleaved: on a shared machine (2 cores here, 4 ranks) speed drifts by tens
of percent over seconds. Timing A for a minute and then B for a minute measures the
drift; alternating A, B, C, then B, C, A, ... in one run (the order rotates, so no
variant always follows the same one) and comparing medians measures the implementations.

A variant is a factory `make(module) -> (model, sync)`: `model(x)` runs forward,
and `sync()` (or None) is what the training loop calls between backward and the
optimizer step -- e.g. `(module, lambda: average_gradients(module))` for naive DDP,
`(ddp, ddp.finish_gradient_sync)` with `ddp = BucketedDDP(module)`, and
`(DistributedDataParallel(module), None)` for torch's DDP, which finishes inside backward.
A third element, if present, wraps the optimizer (Horovod's design:
`(module, None, DistributedOptimizer)`).
"""

import statistics
import time

import torch
import torch.distributed as dist

from .ddp_toys import deep_mlp, loss_fn, regression_data
from .env import rank_device
from .launcher import launch


def step_times(variants, depth=6, width=256, per_rank=32, steps=3, rounds=4, dtype=torch.float32):
    """Inside a rank: time `rounds` x `steps` training steps of every variant, round-robin.

    Returns {name: [seconds per step, ...]} without the first round (warm-up).
    Every step starts after a barrier, so each rank times the same step.
    """
    device = rank_device()
    X, Y = regression_data(per_rank * dist.get_world_size(), d_in=width, d_out=width, seed=1, dtype=dtype)
    rows = slice(dist.get_rank() * per_rank, (dist.get_rank() + 1) * per_rank)
    x, y = X[rows].to(device), Y[rows].to(device)
    built = {}
    for name, make in variants.items():
        module = deep_mlp(depth, width, d_in=width, d_out=width, seed=0, dtype=dtype, device=device)
        model, sync, *wrap = make(module)
        opt = torch.optim.SGD(module.parameters(), lr=1e-3)
        built[name] = (model, sync, wrap[0](opt) if wrap and wrap[0] is not None else opt)
    times = {name: [] for name in variants}
    names = list(built)
    for round_ in range(rounds):
        shift = round_ % len(names)  # rotate the order each round: no variant always runs after another
        for name in names[shift:] + names[:shift]:
            model, sync, opt = built[name]
            for _ in range(steps):
                dist.barrier()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                opt.zero_grad()
                loss_fn(model(x), y).backward()
                if sync is not None:
                    sync()
                opt.step()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if round_:
                    times[name].append(time.perf_counter() - start)
    return times


def compare_step_times(variants, world_size, **options):
    """Launch `world_size` ranks running `step_times`; return {name: median seconds per step on rank 0}."""
    deadline = options.pop("deadline", 300)
    results = launch(step_times, world_size, variants, deadline=deadline, **options)
    return {name: statistics.median(times) for name, times in results[0].items()}


def print_ratios(medians_by_world_size, baseline):
    """A table: median step time of each variant and its ratio to `baseline`, per world size."""
    names = list(next(iter(medians_by_world_size.values())))
    print(f"{'N':>3}  " + "  ".join(f"{name:>22}" for name in names))
    for world_size, medians in medians_by_world_size.items():
        cells = [f"{medians[n] * 1e3:8.1f} ms ({medians[n] / medians[baseline]:4.2f}x)" for n in names]
        print(f"{world_size:>3}  " + "  ".join(f"{c:>22}" for c in cells))
    print(f"(ratio: step time / step time of {baseline}, medians, same run)")
