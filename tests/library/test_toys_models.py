"""dpcourse.toys.models:
seeded models and data, shares of a global batch, and the single-process yardstick.
"""

import pytest
import torch
import torch.distributed as dist

from dpcourse import launch
from dpcourse.checks.params import (
    expect_averaged_gradients,
    expect_identical_across_ranks,
    expect_same_state,
)
from dpcourse.reference.gradients import gradients_of, single_process_gradients, state_of
from dpcourse.reference.training import sgd
from dpcourse.topics.ddp.checks import expect_single_process_equivalence
from dpcourse.toys.data import my_share, smooth_regression_data
from dpcourse.toys.models import MODELS, deep_mlp, loss_fn
from markers import exercise


def test_models_are_seeded_without_touching_the_global_generator():
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a, b, c = deep_mlp(seed=1), deep_mlp(seed=1), deep_mlp(seed=2)
    assert torch.equal(torch.rand(3), before)
    expect_same_state(state_of(a), state_of(b), "same seed", atol=0)
    with pytest.raises(AssertionError, match="fc0.weight"):
        expect_same_state(state_of(c), state_of(a), "other seed", atol=0)
    for name, make in MODELS.items():
        assert make(seed=0)(torch.zeros(3, 8, dtype=torch.float64)).shape == (3, 2), name


def test_data_is_reproducible_and_shares_partition_each_global_batch():
    X, Y = smooth_regression_data(24, seed=4)
    assert torch.equal(X, smooth_regression_data(24, seed=4)[0]) and X.dtype == torch.float64
    shares = [my_share(X, Y, 1, 3, rank, 4, "cpu")[0] for rank in range(4)]
    assert torch.equal(torch.cat(shares), X[12:24])


def test_gradient_messages_say_what_the_gradient_looks_like():
    model = deep_mlp(seed=0)
    X, Y = smooth_regression_data(8, seed=1)
    average = single_process_gradients(model, X, Y)
    local = single_process_gradients(model, X[:4], Y[:4])
    expect_averaged_gradients(average, average, local, 2, "ok")
    cases = {"2 times the average": {k: 2 * v for k, v in average.items()},
             "not all-reduced": {**average, "fc1.bias": local["fc1.bias"]},
             "had not finished": {k: v / 2 for k, v in local.items()}}
    for hint, got in cases.items():
        with pytest.raises(AssertionError, match=hint):
            expect_averaged_gradients(got, average, local, 2, "case", rank=0)
    with pytest.raises(AssertionError, match="fc0.weight has no gradient"):
        expect_averaged_gradients({**average, "fc0.weight": None}, average, local, 2, "case")


def test_expect_identical_across_ranks_catches_a_drifting_rank():
    state = state_of(deep_mlp(seed=0))
    other = {**state, "head.bias": state["head.bias"] + 1e-12}
    with pytest.raises(AssertionError, match="rank 1's parameters differ from rank 0's: head.bias"):
        expect_identical_across_ranks([state, other])


def _train(X, Y, steps, per_rank, divide):
    model = deep_mlp(seed=0)
    opt = sgd(model)
    for step in range(steps):
        xb, yb = my_share(X, Y, step, per_rank)
        opt.zero_grad()
        loss_fn(model(xb), yb).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            if divide:
                p.grad /= dist.get_world_size()
        if step == 0:
            first = gradients_of(model)
        opt.step()
    return first, state_of(model)


@exercise("average_gradients", "bucketed_ddp", "accumulating_ddp", "distributed_optimizer")
def test_averaged_gradients_on_ranks_equal_one_process_and_summed_ones_do_not():
    X, Y = smooth_regression_data(18, seed=2)
    good = launch(_train, 3, X, Y, 2, 3, True)
    expect_single_process_equivalence(good, lambda: deep_mlp(seed=0), X, Y, 2, 3, "averaged")
    bad = launch(_train, 3, X, Y, 2, 3, False)
    with pytest.raises(AssertionError, match="3 times the average"):
        expect_single_process_equivalence(bad, lambda: deep_mlp(seed=0), X, Y, 2, 3, "summed")
