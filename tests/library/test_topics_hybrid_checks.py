"""dpcourse.topics.hybrid.runs and checks on training: the instructor's steps pass on every grid,
each known mistake fails with the message that names it, and the bytes formulas of `traffic` are
what the steps really send (checked by the same verdicts)."""

import functools
import re

import pytest
import torch
import torch.distributed as dist

from dpcourse.topics.hybrid.checks import expect_dp_pp, expect_dp_tp
from dpcourse.topics.hybrid.runs import run_dp_pp_cases, run_dp_tp_cases
from dpcourse.topics.tensor.models import inputs
from dpgrader.hybrid_parallelism.tuned import dp_pp_step, dp_tp_step, plain_dp_pp_step, plain_dp_tp_step
from markers import exercise


def batches(rows, d_in, d_out, steps, seed):
    return [(inputs((rows, d_in), seed=seed + s), inputs((rows, d_out), seed=seed + 50 + s))
            for s in range(steps)]


TP_CASES = [dict(grid=(2, 2), model=dict(blocks=2, seed=1), lr=0.2, batches=batches(8, 6, 3, 3, 0)),
            dict(grid=(1, 4), model=dict(blocks=1, bias=False, seed=2), lr=0.2,
                 batches=batches(4, 6, 3, 2, 10)),
            dict(grid=(4, 1), model=dict(blocks=1, seed=3), lr=0.2, batches=batches(8, 6, 3, 2, 20))]
PP_CASES = [dict(grid=(2, 2), model=dict(width=5, layers=4, seed=4), cuts=[0, 4, 7], n_micro=2, lr=0.2,
                 batches=batches(8, 5, 5, 3, 30)),
            dict(grid=(1, 4), model=dict(width=5, layers=3, seed=5), cuts=[0, 1, 2, 3, 5], n_micro=2, lr=0.2,
                 batches=batches(4, 5, 5, 2, 40)),
            dict(grid=(4, 1), model=dict(width=5, layers=2, seed=6), cuts=[0, 3], n_micro=1, lr=0.2,
                 batches=batches(8, 5, 5, 2, 50))]


@exercise("hybrid_dp_tp_step")
@pytest.mark.parametrize("step", [dp_tp_step, plain_dp_tp_step])
def test_data_x_tensor_steps_pass_on_every_grid(step):
    for case, runs in zip(TP_CASES, run_dp_tp_cases(step, TP_CASES), strict=True):
        expect_dp_tp(runs, case, str(case["grid"]))


@exercise("hybrid_dp_pp_step")
@pytest.mark.parametrize("step", [dp_pp_step, plain_dp_pp_step])
def test_data_x_pipeline_steps_pass_on_every_grid(step):
    for case, runs in zip(PP_CASES, run_dp_pp_cases(step, PP_CASES), strict=True):
        expect_dp_pp(runs, case, str(case["grid"]))


def tp_bug(kind, model, grid, batch, targets, loss_fn, lr):
    dp, replica = grid.sizes["dp"], grid.coords["dp"]
    if kind == "rows by world rank":
        x = batch.tensor_split(dist.get_world_size())[dist.get_rank()]
        y = targets.tensor_split(dist.get_world_size())[dist.get_rank()]
    else:
        x, y = batch.tensor_split(dp)[replica], targets.tensor_split(dp)[replica]
    loss = loss_fn(model(x), y)
    loss.backward()
    if kind == "loss all-reduced":
        dist.all_reduce(loss.detach().clone(), group=grid.groups["dp"])
    group = {"over tp": grid.groups["tp"], "over the world": None}.get(kind, grid.groups["dp"])
    with torch.no_grad():
        for p in model.parameters():
            dist.all_reduce(p.grad, group=group)
            if kind == "dp and tp":
                dist.all_reduce(p.grad, group=grid.groups["tp"])
            p -= lr * p.grad / (1 if kind == "summed" else dp)
            if kind != "not cleared":
                p.grad = None
    return loss if kind == "a tensor" else loss.item()


@exercise("hybrid_dp_tp_step")
@pytest.mark.parametrize("kind, message", [
    ("over tp", "parameter gradients are not all-reduced over tp"),
    ("dp and tp", "parameter gradients are not all-reduced over tp"),
    ("over the world", "outside its groups (tp (0, 1), dp (0, 2)) -- the whole world"),
    ("summed", "the update is 2x the expected values"),
    ("rows by world rank", "the same rows on every rank of the replica"),
    ("not cleared", "the previous step's gradient was added in again"),
    ("a tensor", "returned torch.Tensor (requires_grad=True); expected a Python float"),
    ("loss all-reduced", "ran all_reduce of 8 bytes -- a single value, the loss?"),
])
def test_data_x_tensor_mistakes_are_named(kind, message):
    case = TP_CASES[0]
    runs = run_dp_tp_cases(functools.partial(tp_bug, kind), [case])[0]
    with pytest.raises(AssertionError, match=re.escape(message)):
        expect_dp_tp(runs, case, "2 x 2")


def pp_bug(kind, model, cuts, grid, batch, targets, loss_fn, n_micro, lr, pipeline_step):
    from dpcourse.topics.pipeline.stages import make_stage

    ranks = None if kind == "neighbours by position" else grid.members("pp")
    stage = make_stage(model, cuts, grid.coords["pp"], ranks=ranks)
    dp = grid.sizes["dp"]
    replica = grid.coords["pp"] if kind == "rows by stage" else grid.coords["dp"]
    loss = pipeline_step(stage, batch.tensor_split(dp)[replica], targets.tensor_split(dp)[replica], loss_fn,
                         n_micro)
    group = grid.groups["pp"] if kind == "over the pipeline" else grid.groups["dp"]
    with torch.no_grad():
        for p in stage.module.parameters():
            dist.all_reduce(p.grad, group=group)
            p -= lr * p.grad / dp
            p.grad = None
    return loss


@exercise("hybrid_dp_pp_step")
@pytest.mark.parametrize("kind, message", [
    ("neighbours by position", "outside its pipeline (2, 3)"),
    ("over the pipeline", "outside its groups (dp (0, 2)) -- that is its pp group"),
    ("rows by stage", "the same rows on every rank of the replica"),
])
def test_data_x_pipeline_mistakes_are_named(kind, message):
    case = PP_CASES[0]
    runs = run_dp_pp_cases(functools.partial(pp_bug, kind), [case])[0]
    with pytest.raises(AssertionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        expect_dp_pp(runs, case, "2 x 2")


def raises_on_rank_2(model, grid, batch, targets, loss_fn, lr):
    if dist.get_rank() == 2:
        raise NotImplementedError("not written yet")
    return dp_tp_step(model, grid, batch, targets, loss_fn, lr)


@exercise("hybrid_dp_tp_step")
def test_an_exception_in_a_step_is_reported_with_its_rank_and_step():
    runs = run_dp_tp_cases(raises_on_rank_2, [TP_CASES[0]])[0]
    with pytest.raises(AssertionError, match="rank 2 raised in step 1: NotImplementedError: not written yet"):
        expect_dp_tp(runs, TP_CASES[0], "2 x 2")


@exercise("make_grid_groups", "hybrid_dp_tp_step", "hybrid_dp_pp_step")
def test_a_demo_re_raises_the_first_failed_rank():
    from dpcourse.comm.cases import RankRun
    from dpcourse.topics.hybrid.runs import DEFAULTS, raise_failure

    def run(rank, **values):
        return RankRun(rank, (0, 1), values={**DEFAULTS, **values})

    raise_failure([run(0), run(1)])                               # nothing failed: nothing raised
    with pytest.raises(NotImplementedError):
        raise_failure([{"error": None}, {"error": "NotImplementedError: "}])
    with pytest.raises(RuntimeError, match="rank 1: ValueError: bad"):
        raise_failure([run(0), run(1, error="ValueError: bad")])
