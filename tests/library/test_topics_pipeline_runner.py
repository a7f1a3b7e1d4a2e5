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
    expect_released,
    expect_schedule,
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


def scheduled_step(stage, batch, targets, loss_fn, schedule, scale=True, blocking=False, keep=False,
                   other_stages=None):
    """A correct executor of any schedule (blocking=True: sends wait, which deadlocks 1F1B; keep=True:
    finished micro-batches stay in the dict; other_stages: what the stages but the last return)."""
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
            x, out = held[i] if keep else held.pop(i)
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
    return total if stage.is_last else other_stages


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


def test_only_the_last_stage_returns_a_value():
    case = PipelineCase(MODEL, [0, 3, 5], X, Y, n_micro=3, schedule=gpipe)
    calls = run_pipeline(partial(scheduled_step, other_stages=0.0), case, exercise="step")
    with pytest.raises(AssertionError,
                       match=r"stage 0 \(rank 0\) returned 0.0: every stage but the last must return None"):
        expect_pipeline_step(calls, case, "zero")


def test_what_a_finished_micro_batch_keeps_is_found_and_its_cause_named():
    """scheduled_step waits for its sends at the end: each request keeps the activation it sent; kept in
    the dict, the tensors are still named by the learner's code."""
    case = PipelineCase(MODEL, [0, 3, 5], X, Y, schedule=ONE_F_ONE_B)
    calls = run_pipeline(scheduled_step, case, exercise="step")
    expect_held(calls, case, "1F1B", [2, 1], at_most=True)  # autograd's saved tensors are freed
    shared = (r"stage 0 \(rank 0\): when the backward of micro-batch 1 started, micro-batch 0, whose "
              r"backward had already run, still had its output alive -- ")
    with pytest.raises(AssertionError, match=shared + r"no name of yours holds it, but something shares its "
                                                      r"memory: the request of a dist.isend"):
        expect_released(calls, case, "requests")
    calls = run_pipeline(partial(scheduled_step, keep=True), case, exercise="step")
    with pytest.raises(AssertionError, match=shared + r"your code still refers to its output tensor"):
        expect_released(calls, case, "dict")
    assert calls[1].observed["lingering"][0] == [1, 0, ["input"], ["input"]]  # the last stage: its input


def releasing_step(stage, batch, targets, loss_fn, schedule):
    """scheduled_step that waits for each send before the next one in its direction (the exercise's rule)."""
    m = sum(1 for kind, _ in schedule if kind == "F")
    xs, ys = batch.tensor_split(m), targets.tensor_split(m)
    held, pending, total = {}, {}, 0.0

    def send(direction, tensor, peer):
        if direction in pending:
            pending.pop(direction).wait()
        pending[direction] = dist.isend(tensor, peer)

    for kind, i in schedule:
        if kind == "F":
            x = xs[i]
            if not stage.is_first:
                x = torch.empty(len(xs[i]), stage.in_features, dtype=stage.dtype)
                dist.recv(x, stage.prev)
                x.requires_grad_()
            out = stage.module(x)
            if stage.is_last:
                out = loss_fn(out, ys[i]) / m
                total += out.item()
            else:
                send("forward", out.detach(), stage.next)
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
                send("backward", x.grad, stage.prev)
    for work in pending.values():
        work.wait()
    return total if stage.is_last else None


def test_a_step_that_lets_finished_micro_batches_go_passes_after_a_warm_up_too():
    table = ["F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5", "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5",
             "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5", "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"]
    wide = partial(layer_stack, [4, 8, 8, 8, 3], seed=0)
    X12 = torch.randn(12, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    Y12 = torch.randn(12, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    cases = [PipelineCase(wide, [0, 1, 3, 5, 7], X12, Y12, schedule=[parse_order(t) for t in table],
                          placement=[2, 0, 3, 1], warmup=1),
             PipelineCase(wide, [0, 1, 3, 5, 7], X12, Y12, schedule=gpipe, n_micro=4, warmup=1)]
    for case, calls in zip(cases, run_pipeline_cases(releasing_step, cases, exercise="step"), strict=True):
        expect_pipeline_step(calls, case, "releasing")
        expect_released(calls, case, "releasing")
    expect_held(calls, cases[1], "gpipe", [4, 4, 4, 4])


def off_by_one_neighbours(stage, batch, targets, loss_fn):
    """Neighbours computed from the rank: stage 1 on rank 0 receives from rank -1."""
    rank = dist.get_rank()
    x = batch
    if not stage.is_first:
        x = torch.empty(len(batch), stage.in_features, dtype=stage.dtype)
        dist.recv(x, rank - 1)
    out = stage.module(x)
    if not stage.is_last:
        dist.send(out.detach(), rank + 1)


def test_a_neighbour_that_does_not_exist_is_refused_on_every_stage_that_named_it():
    case = PipelineCase(MODEL, [0, 1, 2, 5], X, Y, placement=[2, 0, 1])
    with pytest.raises(AssertionError) as error:
        run_pipeline(off_by_one_neighbours, case, exercise="step", group_timeout=2)
    message = str(error.value)
    assert message.startswith("step named a rank that does not exist in a send or recv, on ranks 0 and 2:")
    assert ("rank 0, stage 1 before its first forward: recv from rank -1: there is no rank -1 (the ranks are "
            "0 to 2) -- stage 1 runs on rank 0; its neighbours are stage.prev = 2 and stage.next = 1 (world "
            "ranks): name them by stage.prev and stage.next, not rank - 1 and rank + 1") in message
    assert "rank 2, stage 0 after the forward of micro-batch 0: send to rank 3" in message


def test_a_deadlock_on_a_non_neighbour_advises_the_neighbours_not_isend():
    def waits_on_a_stranger(stage, batch, targets, loss_fn):
        if stage.index == 1:  # waits for its activation from the last stage's rank, not stage 0's
            dist.recv(torch.empty(len(batch), stage.in_features, dtype=stage.dtype), stage.ranks[-1])

    case = PipelineCase(MODEL, [0, 1, 2, 3, 5], X, Y)
    with pytest.raises(AssertionError) as error:
        run_pipeline(waits_on_a_stranger, case, exercise="step", group_timeout=2)
    message = str(error.value)
    assert "is not a neighbour of stage 1" in message and "not rank - 1 and rank + 1" in message
    assert "dist.isend" not in message


def test_schedules_are_compared_in_the_texts_notation_at_the_first_difference():
    expect_schedule([("F", 0), ("B", 0)], parse_order("F0 B0"), "f()")
    with pytest.raises(AssertionError, match=r"f\(\) returned F0 B0 F1 B1, expected F0 F1 B0 B1: step 2 is "
                                             r"B0 where F1 was expected \(why\)"):
        expect_schedule([("F", 0), ("B", 0), ("F", 1), ("B", 1)], parse_order("F0 F1 B0 B1"), "f()",
                        rule=" (why)")
    with pytest.raises(AssertionError, match=r"step 3 is missing where B1 was expected"):
        expect_schedule([["F", 0], ["B", 0]], parse_order("F0 B0 B1"), "f()")
    with pytest.raises(AssertionError, match=r"f\(\) returned 'F0 B0': expected a list of"):
        expect_schedule("F0 B0", parse_order("F0 B0"), "f()")


@exercise("naive_pipeline_step", "gpipe_step", "run_schedule")
def test_while_graded_a_rank_is_sent_its_own_stage_only():
    """The case runner's Case of a pipeline (runner.as_case, PipelineCase.for_rank): a stage cannot compute
    another stage's part from what it was handed, only from its neighbours' messages."""
    from dpcourse.topics.pipeline.runner import as_case

    case = PipelineCase(MODEL, [0, 2, 5], X, Y, n_micro=2, placement=[2, 0])  # stage 0 on rank 2
    whole = dict(MODEL().named_parameters())
    runnable = as_case(case, 3)
    for rank, index in ((2, 0), (0, 1)):
        seen = runnable.for_rank(rank).part
        for name, parameter in seen.make_model().named_parameters():
            mine = case.cuts[index] <= int(name.split(".")[0]) < case.cuts[index + 1]
            assert torch.equal(parameter, whole[name] if mine else torch.zeros_like(parameter)), (rank, name)
        assert torch.equal(seen.batch, X if index == 0 else torch.zeros_like(X))
        assert torch.equal(seen.targets, Y if index == 1 else torch.zeros_like(Y))
        assert seen.widths == case.widths
    assert runnable.for_rank(1).part is None and runnable.for_rank(1).shared is None  # sits out, sent nothing
