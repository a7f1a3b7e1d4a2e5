"""pipeline.compare and pipeline.bench: torch's ScheduleGPipe / Schedule1F1B run like a learner's step (same
gradients as one process, 1F1B's order and memory), and the timing harness returns per-variant times."""

from functools import partial

import pytest
import torch

from dpcourse import launch
from dpcourse.topics.pipeline.bench import pipeline_step_times, schedule_runner, torch_runner
from dpcourse.topics.pipeline.checks import (
    expect_held,
    expect_order,
    expect_pipeline_step,
    expect_pipeline_traffic,
)
from dpcourse.topics.pipeline.compare import torch_schedule_step
from dpcourse.topics.pipeline.runner import PipelineCase, run_pipeline
from dpcourse.topics.pipeline.schedules import gpipe_schedule, parse_order
from dpcourse.topics.pipeline.stages import layer_stack
from markers import exercise

pytestmark = [pytest.mark.usefixtures("no_orphans"), *exercise("run_schedule")]

MODEL = partial(layer_stack, [4, 8, 8, 8, 3], seed=0)  # 7 layers
g = torch.Generator().manual_seed(0)
X = torch.randn(12, 4, generator=g, dtype=torch.float64)
Y = torch.randn(12, 3, generator=g, dtype=torch.float64)
# 1F1B on 3 stages, 4 micro-batches, as torch 2.13's Schedule1F1B runs it
TORCH_1F1B = [parse_order("F0 F1 F2 B0 F3 B1 B2 B3"), parse_order("F0 F1 B0 F2 B1 F3 B2 B3"),
              parse_order("F0 B0 F1 B1 F2 B2 F3 B3")]


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_torch_schedules_equal_one_process_with_the_expected_order_and_memory(schedule):
    case = PipelineCase(MODEL, [0, 2, 4, 7], X, Y, n_micro=4)
    calls = run_pipeline(partial(torch_schedule_step, schedule=schedule), case, exercise=schedule)
    expect_pipeline_step(calls, case, schedule)
    expect_pipeline_traffic(calls, case, schedule)  # the warm-up step's shape messages are forgotten
    if schedule == "GPipe":
        expect_order(calls, case, schedule, [gpipe_schedule(3, 4, s) for s in range(3)])
        expect_held(calls, case, schedule, [4, 4, 4])
    else:
        expect_order(calls, case, schedule, TORCH_1F1B)
        expect_held(calls, case, schedule, [3, 2, 1])


def plain_step(stage, batch, targets, loss_fn, schedule):
    m = sum(1 for kind, _ in schedule if kind == "F")
    xs, ys = batch.tensor_split(m), targets.tensor_split(m)
    outs = []
    for i in range(m):  # GPipe with blocking calls, for the timing harness
        x = xs[i]
        if not stage.is_first:
            x = torch.empty(len(x), stage.in_features, dtype=stage.dtype)
            torch.distributed.recv(x, stage.prev)
            x.requires_grad_()
        out = stage.module(x)
        if stage.is_last:
            out = loss_fn(out, ys[i]) / m
        else:
            torch.distributed.send(out.detach(), stage.next)
        outs.append((x, out))
    for x, out in outs:
        if stage.is_last:
            out.backward()
        else:
            grad = torch.empty_like(out)
            torch.distributed.recv(grad, stage.next)
            out.backward(grad)
        if not stage.is_first:
            torch.distributed.send(x.grad, stage.prev)


def test_the_timing_harness_times_every_variant_after_a_warm_up():
    variants = {"gpipe": schedule_runner(plain_step, gpipe_schedule), "torch": torch_runner("1F1B")}
    X32, Y32 = X.float(), Y.float()
    times = launch(pipeline_step_times, 2, variants, partial(MODEL, dtype=torch.float32), [0, 3, 7], X32, Y32,
                   4, 2, 2)[0]
    assert set(times) == {"gpipe", "torch"}
    assert all(len(t) == 4 and all(s > 0 for s in t) for t in times.values())
