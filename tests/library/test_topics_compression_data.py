"""dpcourse.topics.compression.data: sums of its gradients are exact in any order; the held-out rows
belong to the same regression problem as the training rows."""

import itertools

import pytest
import torch

from dpcourse.topics.compression.data import (
    EXACT,
    boundary_tie,
    dyadic_gradients,
    dyadic_tensor,
    task_data,
    task_with_held_out,
)
from markers import chapter, exercise


@exercise("topk_all_reduce")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sums_of_a_few_gradients_are_the_same_in_every_order(dtype):
    grads = dyadic_gradients(4, 4, 500, seed=5, dtype=dtype)
    terms = [g for rank in grads for g in rank]  # 16 values per entry: 4 ranks x 4 steps of residual
    sums = {tuple(sum(order, torch.zeros_like(terms[0])).tolist())
            for order in itertools.islice(itertools.permutations(terms), 0, 200, 37)}
    assert len(sums) == 1
    exact = sum(t.double() for t in terms)
    assert torch.equal(sum(terms, torch.zeros_like(terms[0])).double(), exact)
    assert torch.equal(exact / 4, (exact / 4).to(dtype).double())


@exercise("topk_all_reduce")
def test_values_are_multiples_of_the_step_below_the_bound():
    for dtype, (bits, scale) in EXACT.items():
        x = dyadic_tensor(10_000, torch.Generator().manual_seed(0), dtype).double()
        assert torch.equal(x * 2 ** scale, (x * 2 ** scale).round())
        assert x.abs().max() < 2 ** bits
    with pytest.raises(ValueError, match="exact gradients exist for"):
        dyadic_tensor(3, torch.Generator(), torch.float16)


@chapter("less_communication")
def test_a_tie_at_the_k_boundary_is_seen():
    assert boundary_tie(torch.tensor([5.0, -3.0, 3.0, 1.0]), 2)
    assert not boundary_tie(torch.tensor([5.0, -3.0, 3.0, 1.0]), 1)
    assert not boundary_tie(torch.tensor([5.0, -3.0, 3.0, 1.0]), 4)


@exercise("powersgd_hook", "local_sgd", "async_sgd")
def test_held_out_rows_come_from_the_same_problem():
    X, Y, Xh, Yh = task_with_held_out(4, 8, 2, seed=1)
    assert X.shape == (64, 8) and Xh.shape == (256, 8)
    whole_X, whole_Y = task_data(4 * 8 * 2 + 256, 1, 1, seed=1)
    assert torch.equal(torch.cat([X, Xh]), whole_X) and torch.equal(torch.cat([Y, Yh]), whole_Y)
    # a least-squares fit on the training rows explains the held-out rows about as well
    w = torch.linalg.lstsq(X, Y).solution
    assert ((Xh @ w - Yh) ** 2).mean() < 2 * ((X @ w - Y) ** 2).mean() + 0.05
