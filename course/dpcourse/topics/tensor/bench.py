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

import torch

from dpcourse.backend import rank_device
from dpcourse.runtime.launcher import launch
from dpcourse.runtime.timing import interleaved_step_times
from dpcourse.topics.tensor.models import inputs, mlp
from dpcourse.toys.bench import paired_ratios


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

    def step_of(module, opt):
        def step():
            opt.zero_grad()
            x.grad = None
            ((module(x) - target) ** 2).mean().backward()
            opt.step()
        return step

    return interleaved_step_times({name: step_of(*built[name]) for name in built}, rounds, steps)


def compare_tp_step_times(variants, world_size, baseline, deadline=300, **options):
    """Launch world_size ranks running tp_step_times; return ({name: median seconds on rank 0},
    {name: paired ratio to the baseline})."""
    steps = options.get("steps", 3)
    times = launch(tp_step_times, world_size, variants, deadline=deadline, **options)[0]
    medians = {name: statistics.median(values) for name, values in times.items()}
    return medians, paired_ratios(times, baseline, steps)
