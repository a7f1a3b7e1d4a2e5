"""Time pipeline steps of several implementations on the same model, interleaved, and compare medians.

    variants = {"yours": schedule_runner(run_schedule, one_f_one_b), "torch 1F1B": torch_runner("1F1B")}
    times = launch(pipeline_step_times, 4, variants, partial(layer_stack, [512] * 9, dtype=torch.float32),
                   [0, 4, 8, 12, 15], X, Y, 8)[0]
    paired_ratios(times, "torch 1F1B", steps=3)          # dpcourse.toys.bench

A variant is a factory `make(stage, loss_fn, n_micro) -> step(batch, targets)` called once
per rank, so that what an implementation builds once (torch's PipelineStage and schedule,
preallocated buffers) is built once; `step` runs one training step (forward, backward,
gradients accumulated on the stage's parameters). Every variant gets its own copy of the
model, built from the same seed.

Why interleaved rounds (order rotated each round, a barrier before and after each step):
on a shared two-core machine speed drifts by tens of percent within seconds, so A, B, A,
B, ... in one run measures the implementations, not the drift (as for DDP in notebook 05).
The time of a step is rank 0's, from the barrier before it to the barrier after it: the
step is over when the last stage has finished too.

Used by notebook 07 and tests/bench/bench_pipeline.py.
"""

import time

import torch
import torch.distributed as dist

from dpcourse.backend import rank_device
from dpcourse.topics.pipeline.stages import make_stage
from dpcourse.toys.models import loss_fn as mse_loss


def schedule_runner(run_schedule, schedule):
    """A variant running `run_schedule(stage, batch, targets, loss_fn, schedule(p, m, s))`."""
    def make(stage, loss_fn, n_micro):
        order = schedule(stage.n_stages, n_micro, stage.index)
        return lambda batch, targets: run_schedule(stage, batch, targets, loss_fn, order)
    return make


def torch_runner(schedule="1F1B"):
    """A variant running torch's ScheduleGPipe or Schedule1F1B on a PipelineStage built once."""
    def make(stage, loss_fn, n_micro):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        kind = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[schedule]
        runner = kind(PipelineStage(stage.module, stage.index, stage.n_stages, stage.device),
                      n_microbatches=n_micro, loss_fn=loss_fn)

        def step(batch, targets):
            if stage.is_first and stage.is_last:
                return runner.step(batch, target=targets)
            if stage.is_first:
                return runner.step(batch)
            if stage.is_last:
                return runner.step(target=targets)
            return runner.step()
        return step
    return make


def pipeline_step_times(variants, make_model, cuts, batch, targets, n_micro, steps=3, rounds=5,
                        loss_fn=mse_loss):
    """Inside a rank (stage s on rank s): {name: [seconds per step, ...]} without the warm-up step."""
    device = rank_device()
    x, y = batch.to(device), targets.to(device)
    built = {}
    for name, make in variants.items():
        stage = make_stage(make_model(), cuts, dist.get_rank(), device=device)
        built[name] = (stage, make(stage, loss_fn, n_micro))
    for stage, step in built.values():  # warm-up: shapes, buffers, first-call costs
        step(x, y)
        stage.module.zero_grad(set_to_none=True)
    times = {name: [] for name in variants}
    names = list(built)
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            stage, step = built[name]
            for _ in range(steps):
                dist.barrier()
                _sync(device)
                start = time.perf_counter()
                step(x, y)
                _sync(device)
                dist.barrier()
                times[name].append(time.perf_counter() - start)
                stage.module.zero_grad(set_to_none=True)
    return times


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
