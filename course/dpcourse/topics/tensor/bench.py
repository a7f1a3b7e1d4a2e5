"""Training-step times of tensor-parallel MLPs, interleaved in one run (notebook 08, `make bench`).

    medians, ratios = compare_tp_step_times({"yours": yours, "parallelize_module": torchs}, 2,
                                            baseline="parallelize_module")

A variant is a factory `make(mlp) -> module` called inside each rank with the same unsharded
MLP (e.g. `lambda mlp: TensorParallelMLP(mlp, None)`, or torch's `parallelize_mlp(mlp,
tp_mesh())`). Every variant trains on the same replicated batch with plain SGD; steps start
after a barrier, the order of the variants rotates every round, the first round is warm-up,
and ratios pair each round with itself (topics.ddp.bench explains why).
"""

import statistics
import time

import torch
import torch.distributed as dist

from dpcourse.runtime.backend import rank_device
from dpcourse.runtime.launcher import launch
from dpcourse.topics.ddp.bench import paired_ratios
from dpcourse.topics.tensor.models import inputs, mlp


def tp_step_times(variants, d_model=512, d_hidden=2048, tokens=256, steps=3, rounds=5, dtype=torch.float32):
    """Inside a rank: {name: [seconds per step, ...]} of every variant, warm-up round left out."""
    device = rank_device()
    full = mlp(d_model, d_hidden, seed=0, dtype=dtype, device=device)
    # x requires grad, as the output of the layer before this one would: the backward all-reduce (f) runs
    x = inputs((tokens, d_model), seed=1, dtype=dtype).to(device).requires_grad_()
    target = inputs((tokens, d_model), seed=2, dtype=dtype).to(device)
    built = {}
    for name, make in variants.items():
        module = make(full)
        built[name] = (module, torch.optim.SGD(module.parameters(), lr=1e-3, foreach=False))
    times = {name: [] for name in variants}
    names = list(built)
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            module, opt = built[name]
            for _ in range(steps):
                dist.barrier()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                opt.zero_grad()
                x.grad = None
                ((module(x) - target) ** 2).mean().backward()
                opt.step()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if round_:
                    times[name].append(time.perf_counter() - start)
    return times


def compare_tp_step_times(variants, world_size, baseline, deadline=300, **options):
    """Launch world_size ranks running tp_step_times; return ({name: median seconds on rank 0},
    {name: paired ratio to the baseline})."""
    steps = options.get("steps", 3)
    times = launch(tp_step_times, world_size, variants, deadline=deadline, **options)[0]
    medians = {name: statistics.median(values) for name, values in times.items()}
    return medians, paired_ratios(times, baseline, steps)
