"""pipeline.runner and checks.pipeline: steps run one stage per rank, p2p only, watched (times, activations
held), judged against one process; deadlocks, wrong peers, wrong scaling and wrong order become sentences."""

import time
from functools import partial

import pytest
import torch
import torch.distributed as dist

from dpcourse import LaunchError
from dpcourse.topics.pipeline.checks import (
    expect_held,
    expect_order,
    expect_pipeline_step,
    expect_pipeline_traffic,
    reference_step,
)
from dpcourse.topics.pipeline.runner import PipelineCase, by_stage, run_pipeline, run_pipeline_cases
from dpcourse.topics.pipeline.schedules import gpipe_schedule, parse_order
from dpcourse.topics.pipeline.stages import layer_stack
from dpcourse.topics.pipeline.timeline import measured_bubble, stage_timelines, typical_durations
from markers import exercise

pytestmark = pytest.mark.usefixtures("no_orphans")

MODEL = partial(layer_stack, [4, 8, 8, 3], seed=0)  # Linear 0, Tanh 1, Linear 2, Tanh 3, Linear 4
g = torch.Generator().manual_seed(0)
X = torch.randn(6, 4, generator=g, dtype=torch.float64)
Y = torch.randn(6, 3, generator=g, dtype=torch.float64)


def scheduled_step(stage, batch, targets, loss_fn, schedule, scale=True, blocking=False):
    """A correct executor of any schedule (blocking=True: sends wait, which deadlocks 1F1B)."""
    m = sum(1 for kind, _ in schedule if kind == "F")
    xs, ys = batch.tensor_split(m), targets.tensor_split(m)
    held, sends, total = {}, [], 0.0
    for kind, i in schedule:
        if kind == "F":
            x = xs[i]
            if not stage.is_first:
                x = torch.empty(len(xs[i]), stage.in_features, dtype=stage.dtype)
                dist.recv(x, stage.prev)
                x.requires_grad_()
            out = stage.module(x)
            if stage.is_last:
                out = loss_fn(out, ys[i]) / (m if scale else 1)
                total += out.item()
            elif blocking:
                dist.send(out.detach(), stage.next)
            else:
                sends.append(dist.isend(out.detach(), stage.next))
            held[i] = (x, out)
        else:
            x, out = held.pop(i)
            if stage.is_last:
                out.backward()
            else:
                grad = torch.empty_like(out)
                dist.recv(grad, stage.next)
                out.backward(grad)
            if not stage.is_first:
                if blocking:
                    dist.send(x.grad, stage.prev)
                else:
                    sends.append(dist.isend(x.grad, stage.prev))
    for work in sends:
        work.wait()
    return total if stage.is_last else None


def gpipe(n_stages, n_micro, stage):
    return gpipe_schedule(n_stages, n_micro, stage)


ONE_F_ONE_B = [parse_order("F0 F1 B0 F2 B1 B2"), parse_order("F0 B0 F1 B1 F2 B2")]  # p = 2, m = 3


@exercise("naive_pipeline_step", "gpipe_step", "run_schedule")
def test_a_correct_step_equals_one_process_and_is_watched():
    case = PipelineCase(MODEL, [0, 3, 5], X, Y, n_micro=3, schedule=gpipe)
    calls = run_pipeline(scheduled_step, case, exercise="step")
    expect_pipeline_step(calls, case, "gpipe")
    expect_pipeline_traffic(calls, case, "gpipe")
    expect_order(calls, case, "gpipe", [gpipe_schedule(2, 3, s) for s in range(2)])
    expect_held(calls, case, "gpipe", [3, 3])
    loss, grads = reference_step(case)
    assert calls[1].result == pytest.approx(loss, rel=1e-12)
    assert set(calls[0].observed["grads"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert all(start <= end for c in calls for _, _, start, end in c.observed["events"])


@exercise("gpipe_step", "run_schedule")
def test_one_f_one_b_holds_fewer_micro_batches_than_gpipe():
    case = PipelineCase(MODEL, [0, 3, 5], X, Y, schedule=ONE_F_ONE_B)
    calls = run_pipeline(scheduled_step, case, exercise="step")
    expect_pipeline_step(calls, case, "1F1B")
    assert [c.observed["peak_held"] for c in by_stage(calls, case)] == [2, 1]
    with pytest.raises(AssertionError, match=r"stage 0 \(rank 0\) held the activations of 2 "
                                             r"micro-batch\(es\) at once, expected at most 1"):
        expect_held(calls, case, "1F1B", [1, 1], at_most=True)


@exercise("naive_pipeline_step", "gpipe_step", "run_schedule")
def test_stages_on_ranks_out_of_order_and_sitting_out_share_one_launch():
    cases = [PipelineCase(MODEL, [0, 1, 2, 5], X, Y, placement=[2, 0, 3], n_micro=2, schedule=gpipe),
             PipelineCase(MODEL, [0, 3, 5], X, Y, placement=[1, 0], n_micro=1, schedule=gpipe)]
    for case, calls in zip(cases, run_pipeline_cases(scheduled_step, cases, exercise="step"), strict=True):
        assert len(calls) == 4
        expect_pipeline_step(calls, case, "placed")
        expect_pipeline_traffic(calls, case, "placed")
        outside = [c for c in calls if c.rank not in case.ranks]
        assert outside and all(c.group_rank is None and not c.ops for c in outside)
    assert cases[0].widths == [4, 8, 8, 3]


@exercise("gpipe_step", "run_schedule")
def test_a_missing_loss_scaling_is_named():
    case = PipelineCase(MODEL, [0, 3, 5], X, Y, n_micro=3, schedule=gpipe)
    calls = run_pipeline(partial(scheduled_step, scale=False), case, exercise="step")
    with pytest.raises(AssertionError, match="3x the expected value: divide each micro-batch's loss by m"):
        expect_pipeline_step(calls, case, "unscaled")


@exercise("naive_pipeline_step", "gpipe_step", "run_schedule")
def test_a_deadlock_names_stages_and_micro_batches_within_seconds():
    case = PipelineCase(MODEL, [0, 3, 5], X, Y, schedule=ONE_F_ONE_B)
    start = time.monotonic()
    with pytest.raises(AssertionError) as error:
        run_pipeline(partial(scheduled_step, blocking=True), case, exercise="step", group_timeout=2)
    assert time.monotonic() - start < 10
    message = str(error.value)
    assert "stage 0 (rank 0): blocked in send to rank 1" in message
    assert "waiting to send the activation of micro-batch 1 (its message 2 to stage 1)" in message
    assert "waiting to send the gradient of micro-batch 0 (its message 1 to stage 0)" in message
    assert "dist.isend" in message


def talks_to_the_wrong_rank(stage, batch, targets, loss_fn):
    """Stage 0 sends its activation to the last stage (not its neighbour); the others skip stage 1."""
    if stage.is_first:
        out = stage.module(batch)
        dist.send(out.detach(), stage.ranks[-1])
    elif stage.is_last:
        x = torch.empty(len(batch), stage.in_features, dtype=stage.dtype)
        dist.recv(x, stage.ranks[0])
    return None


@exercise("naive_pipeline_step", "gpipe_step", "run_schedule")
def test_messages_to_non_neighbours_are_named():
    case = PipelineCase(partial(layer_stack, [4, 4, 4], seed=0), [0, 1, 2, 3], X, X)
    calls = run_pipeline(talks_to_the_wrong_rank, case, exercise="step")
    with pytest.raises(AssertionError, match=r"stage 0 \(rank 0\) called send to rank 2 \(stage 2\): a "
                                             r"stage talks only to its neighbours, here rank 1"):
        expect_pipeline_traffic(calls, case, "wrong peer")


def forgets_requires_grad(stage, batch, targets, loss_fn):
    x = batch
    if not stage.is_first:
        x = torch.empty(len(batch), stage.in_features, dtype=stage.dtype)
        dist.recv(x, stage.prev)
    out = stage.module(x)
    if stage.is_last:
        loss_fn(out, targets).backward()
    else:
        dist.send(out.detach(), stage.next)
        grad = torch.empty_like(out)
        dist.recv(grad, stage.next)
        out.backward(grad)
    if not stage.is_first:
        dist.send(x.grad, stage.prev)


@exercise("naive_pipeline_step", "gpipe_step", "run_schedule")
def test_an_error_in_a_stage_names_the_stage_the_micro_batch_and_the_likely_cause():
    case = PipelineCase(MODEL, [0, 3, 5], X, Y)
    with pytest.raises(LaunchError) as error:
        run_pipeline(forgets_requires_grad, case, exercise="step")
    message = str(error.value)
    assert "stage 1 after the backward of micro-batch 0" in message
    assert "must get requires_grad_()" in message


@exercise("naive_pipeline_step", "gpipe_step", "run_schedule")
def test_a_backward_in_the_wrong_order_is_named():
    reversed_gpipe = [parse_order("F0 F1 F2 B2 B1 B0")] * 2
    case = PipelineCase(MODEL, [0, 3, 5], X, Y, schedule=reversed_gpipe)
    calls = run_pipeline(scheduled_step, case, exercise="step")
    expect_pipeline_step(calls, case, "reversed")  # consistent on both stages: the gradients are right
    with pytest.raises(AssertionError, match="step 4 is B2 where B0 was expected"):
        expect_order(calls, case, "reversed", [gpipe_schedule(2, 3, s) for s in range(2)])


@exercise("naive_pipeline_step", "run_schedule")
def test_a_warm_up_step_is_forgotten():
    slow = partial(layer_stack, [4, 4, 4], seed=0, forward_ms=5, backward_ms=10)
    case = PipelineCase(slow, [0, 1, 3], X, X, schedule=ONE_F_ONE_B, warmup=1)
    calls = run_pipeline(scheduled_step, case, exercise="step")
    expect_pipeline_step(calls, case, "after a warm-up")  # gradients of one step, not two
    assert all(len(c.observed["events"]) == 6 and len(c.ops) == 6 for c in calls)
    timelines = stage_timelines(calls, case)
    forward, backward, step = typical_durations(timelines)
    assert forward >= 0.005 and backward >= 0.010 and step >= 4 * (forward + backward)
    assert 0 < measured_bubble(timelines) < 1


@exercise("naive_pipeline_step", "gpipe_step", "run_schedule")
def test_bad_cases_are_refused_before_launching():
    with pytest.raises(ValueError, match="does not split into 4 equal micro-batches"):
        run_pipeline(scheduled_step, PipelineCase(MODEL, [0, 3, 5], X, Y, n_micro=4), exercise="step")
    with pytest.raises(ValueError, match="2 different ranks"):
        run_pipeline(scheduled_step, PipelineCase(MODEL, [0, 3, 5], X, Y, placement=[1, 1]), exercise="step")
