"""dpcourse.checks.params: mismatches are explained (multiples, unmoved parameters, diverged replicas)."""

import copy

import pytest
import torch

from dpcourse.checks.core import expect_close, ratio_hint
from dpcourse.checks.params import (
    expect_gradients,
    expect_parameters,
    expect_replicas_equal,
    expect_shard_calls,
)
from dpcourse.toys.models import linear


def test_ratio_hint_names_multiples_only():
    e = torch.tensor([1.0, -2.0, 3.0])
    assert ratio_hint(4 * e, e) == " (4x the expected values)"
    assert ratio_hint(e + torch.tensor([0.0, 0.0, 1.0]), e) == ""
    assert ratio_hint(e, e) == ""
    assert ratio_hint(e, torch.zeros(3)) == ""


def test_expect_close_explains_shape_nan_and_values():
    e = torch.ones(2, 2)
    expect_close(e.float() + 1e-7, e.double(), "x")
    with pytest.raises(AssertionError, match="x has shape"):
        expect_close(torch.ones(4), e, "x")
    with pytest.raises(AssertionError, match="nan"):
        expect_close(torch.full((2, 2), float("nan")), e, "x")
    with pytest.raises(AssertionError, match=r"\(2x the expected values\)"):
        expect_close(2 * e, e, "x")
    with pytest.raises(AssertionError, match="should be a tensor"):
        expect_close([1.0], e, "x")


def test_expect_gradients_wants_one_tensor_per_parameter():
    with pytest.raises(AssertionError, match="a list of 2 gradient tensors"):
        expect_gradients([torch.ones(1)], [torch.ones(1), torch.ones(1)], ["w", "b"], "case")
    with pytest.raises(AssertionError, match="case, the gradient of b is"):
        expect_gradients([torch.ones(1), torch.zeros(1)], [torch.ones(1), torch.ones(1)], ["w", "b"], "case")


def test_expect_parameters_says_how_far_they_moved():
    start = [torch.zeros(2)]
    expected = [torch.tensor([1.0, 2.0], dtype=torch.float64)]
    expect_parameters([torch.tensor([1.0, 2.0])], expected, ["w"], start, "after")
    with pytest.raises(AssertionError, match="it did not move at all"):
        expect_parameters([torch.zeros(2)], expected, ["w"], start, "after")
    with pytest.raises(AssertionError, match="the update is 3x the reference update"):
        expect_parameters([torch.tensor([3.0, 6.0])], expected, ["w"], start, "after")


def test_expect_replicas_equal_names_the_replica():
    model = linear(1, 1)
    replicas = [model, copy.deepcopy(model), copy.deepcopy(model)]
    expect_replicas_equal(replicas, ["weight", "bias"], "after")
    with torch.no_grad():
        replicas[2].bias += 1
    with pytest.raises(AssertionError, match="replica 2's bias differs from replica 0's"):
        expect_replicas_equal(replicas, ["weight", "bias"], "after")


def test_expect_shard_calls_ignores_order_and_empty_shards():
    expect_shard_calls([2, 3, 0], [3, 2, 0, 0], "case")
    with pytest.raises(AssertionError, match=r"batches of sizes \[5\]"):
        expect_shard_calls([5], [3, 2], "case")
