"""dpcourse.checks.core: one tolerance table, one rendering of values and ranks, one ratio hint."""

import pytest
import torch

from dpcourse.checks.core import (
    describe,
    expect_equal,
    is_close,
    rank_prefix,
    shorten,
    tolerance,
)
from dpcourse.checks.params import expect_same_state


def test_tolerance_takes_the_looser_dtype_and_explicit_bounds_win():
    assert tolerance(torch.float32, torch.float64) == tolerance(torch.float32) == (2e-5, 1e-4)
    assert tolerance(torch.float64) == (1e-9, 1e-7)
    assert tolerance(torch.int64, torch.int64) == (0.0, 0.0)
    assert tolerance(torch.float64, atol=1e-9) == (1e-9, 0.0)  # atol alone: an absolute bound
    assert tolerance(torch.float32, atol=0, rtol=0) == (0.0, 0.0)


def test_is_close_follows_the_table():
    one = torch.ones(3, dtype=torch.float64)
    assert is_close((one + 1e-6).float(), one)  # a float32 result against a float64 reference
    assert not is_close(one + 1e-6, one)  # float64 against float64: 1e-7 relative
    assert not is_close(one + 1e-10, one, atol=0)  # bit for bit
    assert not is_close(torch.ones(2), torch.ones(3))
    assert not is_close(torch.tensor([float("nan")]), torch.tensor([float("nan")]))
    assert is_close(torch.arange(3), torch.arange(3.0)) and not is_close(torch.arange(3), torch.ones(3))


def test_one_rendering_of_values_lists_and_ranks():
    assert shorten(range(3)) == "0, 1, 2"
    assert shorten(range(10), 3) == "0, 1, 2, … (10 values)"
    assert shorten(range(10), 3, fmt=str, more="...") == "0, 1, 2, ..."
    assert describe(torch.arange(10.0), 2) == "tensor([0, 1, … (10 values)], shape=(10,), dtype=float32)"
    assert rank_prefix(2) == "rank 2: " and rank_prefix() == ""


def test_float_mismatches_carry_the_ratio_hint():
    with pytest.raises(AssertionError, match=r"rank 1: x is .* \(2x the expected values\)"):
        expect_equal(2 * torch.tensor([1.0, 3.0]), torch.tensor([1.0, 3.0]), "x", rank=1)
    with pytest.raises(AssertionError, match=r"expected tensor\(\[0, 4\]"):
        expect_equal(torch.tensor([1, 5]), torch.tensor([0, 4]), "ints")


def test_expect_equal_names_both_dtypes_even_when_the_values_match():
    with pytest.raises(AssertionError,
                       match=r"rank 2: idx has dtype float32, expected int64: .*must be integers"):
        expect_equal(torch.tensor([0.0, 4.0]), torch.tensor([0, 4]), "idx", rank=2)
    with pytest.raises(AssertionError, match=r"sum has dtype float32, expected float64"):
        expect_equal(torch.ones(2), torch.ones(2, dtype=torch.float64), "sum")
    expect_equal(torch.tensor([0, 4]), torch.tensor([0, 4]), "same dtype passes")


def test_expect_same_state_tolerances():
    state = {"w": torch.ones(2, dtype=torch.float64), "n": torch.tensor(3)}
    expect_same_state({"w": state["w"] + 1e-12, "n": torch.tensor(3)}, state, "table")
    with pytest.raises(AssertionError, match=r"rank 0: bits: w is .*\(largest difference 1e-12\)"):
        expect_same_state({"w": state["w"] + 1e-12, "n": torch.tensor(3)}, state, "bits", rank=0, atol=0)
    with pytest.raises(AssertionError, match=r"counter: n is tensor\(\[4\].*expected tensor\(\[3\]"):
        expect_same_state({"w": state["w"], "n": torch.tensor(4)}, state, "counter")
    with pytest.raises(AssertionError, match="should be a state_dict"):
        expect_same_state([1], state, "list")


def test_a_known_mistake_is_named_at_the_end_of_the_message():
    from dpcourse.checks.core import expect_close, known_mistake

    right, summed = torch.ones(3, dtype=torch.float64), torch.full((3,), 4.0, dtype=torch.float64)
    suspects = {"the sum, not the mean": summed, "the negation": -right}
    assert known_mistake(summed.float(), suspects) == "the sum, not the mean"
    assert known_mistake([-right], {"the negation": [-right]}) == "the negation"
    assert known_mistake(right + 0.5, suspects) == ""
    with pytest.raises(AssertionError, match=r"\(4x the expected values\): the sum, not the mean$"):
        expect_close(summed.float(), right, "g", hint=known_mistake(summed.float(), suspects))
