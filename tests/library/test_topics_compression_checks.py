"""dpcourse.topics.compression.checks accept right results and refuse wrong ones with the right words.

Results are built here by hand, as runs.py would return them (no ranks needed)."""

import pytest
import torch

from dpcourse.comm.recorder import CommOp
from dpcourse.topics.compression.checks import (
    expect_local_sgd_calls,
    expect_powersgd_bytes,
    expect_server_traffic,
    expect_tensor,
    expect_topk_bytes,
    expect_topk_pair,
    expect_topk_run,
)
from dpcourse.topics.compression.data import dyadic_gradients
from markers import exercise


def op(name, nbytes, peer=None, group=(0, 1)):
    return CommOp(name, peer, nbytes, 0.0, 0.0, group)


def topk_results(grads, k, residual_not_reset=False, no_feedback=False):
    """What a correct (or deliberately wrong) topk_all_reduce returns on each rank, step by step."""
    world_size = len(grads)
    results = [{"averages": [], "residuals": []} for _ in grads]
    residual = [torch.zeros_like(grads[0][0]) for _ in grads]
    for step in range(len(grads[0])):
        sent = []
        for rank in range(world_size):
            acc = grads[rank][step] + (0 if no_feedback else residual[rank])
            top = torch.topk(acc.abs(), k).indices
            s = torch.zeros_like(acc)
            s[top] = acc[top]
            sent.append(s)
            residual[rank] = acc.clone() if residual_not_reset else acc - s
            results[rank]["residuals"].append(residual[rank].clone())
        for rank in range(world_size):
            results[rank]["averages"].append(sum(sent) / world_size)
    return results


@exercise("topk_compress")
def test_topk_pair_accepts_the_k_largest_magnitudes_in_any_order():
    x = torch.tensor([0.5, -3.0, 2.0, 0.0], dtype=torch.float64)
    pair = (torch.tensor([2.0, -3.0], dtype=torch.float64), torch.tensor([2, 1], dtype=torch.int32))
    expect_topk_pair(pair, x, 2)


@exercise("topk_compress")
@pytest.mark.parametrize("values, indices, message", [
    ([2.0, 0.5], [2, 0], "those are the k largest values"),
    ([-3.0, 2.0], [1, 2], "expected torch.int32 (8 bytes per index instead of 4)"),
    ([3.0, 2.0], [1, 2], "keep the signs"),
    ([-3.0], [1], "one value and one index per kept entry"),
])
def test_topk_pair_names_the_mistake(values, indices, message):
    x = torch.tensor([0.5, -3.0, 2.0, 0.0], dtype=torch.float64)
    dtype = torch.int64 if "int32" in message else torch.int32
    got = (torch.tensor(values, dtype=torch.float64), torch.tensor(indices, dtype=dtype))
    with pytest.raises(AssertionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        expect_topk_pair(got, x, 2)


@exercise("topk_all_reduce")
def test_topk_run_accepts_a_correct_run_and_names_each_mistake():
    grads = dyadic_gradients(3, 3, 20, seed=2)
    expect_topk_run(topk_results(grads, 4), grads, 4, exact=False)
    with pytest.raises(AssertionError, match="residual not reset"):
        expect_topk_run(topk_results(grads, 4, residual_not_reset=True), grads, 4)
    with pytest.raises(AssertionError, match="error feedback"):
        expect_topk_run(topk_results(grads, 4, no_feedback=True), grads, 4)
    summed = topk_results(grads, 4)
    for result in summed:
        result["averages"] = [a * 3 for a in result["averages"]]
    with pytest.raises(AssertionError, match="3x the expected values"):
        expect_topk_run(summed, grads, 4)


@exercise("topk_compress", "topk_all_reduce")
def test_bit_for_bit_means_bit_for_bit():
    a = torch.tensor([1.0, 2.0], dtype=torch.float64)
    expect_tensor(a.clone(), a, "x")
    with pytest.raises(AssertionError, match="first difference at index 1"):
        expect_tensor(a + torch.tensor([0.0, 1e-15], dtype=torch.float64), a, "x")
    with pytest.raises(AssertionError, match="dtype torch.float32"):
        expect_tensor(a.float(), a, "x")


@exercise("topk_all_reduce")
def test_topk_bytes():
    good = [{"ops": [op("all_gather", 24), op("all_gather", 12)]}]
    expect_topk_bytes(good, 3, 8, steps=1, numel=12)
    with pytest.raises(AssertionError, match="int64 indices"):
        expect_topk_bytes([{"ops": [op("all_gather", 24), op("all_gather", 24)]}], 3, 8, steps=1, numel=12)
    with pytest.raises(AssertionError, match="a sum of sparse vectors is not sparse"):
        expect_topk_bytes([{"ops": [op("all_reduce", 96)]}], 3, 8, steps=1, numel=12)


SHAPES = {"fc0.weight": (16, 8), "fc0.bias": (16,), "fc1.weight": (16, 16), "fc1.bias": (16,),
          "head.weight": (2, 16), "head.bias": (2,)}


@exercise("powersgd_hook")
def test_powersgd_bytes_and_their_hints():
    right = [{"ops": [op("broadcast", 3600), op("all_reduce", 66 * 8), op("all_reduce", 64 * 8),
                      op("all_reduce", 48 * 8)]}]
    expect_powersgd_bytes(right, SHAPES, 2, 8, steps=1)
    every = [{"ops": [op("all_reduce", 34 * 8), op("all_reduce", 68 * 8), op("all_reduce", 80 * 8)]}]
    with pytest.raises(AssertionError, match="head.weight must travel uncompressed at rank 2"):
        expect_powersgd_bytes(every, SHAPES, 2, 8, steps=1)
    with pytest.raises(AssertionError, match="nothing was compressed"):
        expect_powersgd_bytes([{"ops": [op("all_reduce", 3600)]}], SHAPES, 2, 8, steps=1)


@exercise("local_sgd")
def test_local_sgd_calls_and_their_hints():
    expect_local_sgd_calls([{"ops": [op("all_reduce", 3600)] * 2}], steps=6, H=3, param_bytes=3600, tensors=6)
    with pytest.raises(AssertionError, match="one per step"):
        expect_local_sgd_calls([{"ops": [op("all_reduce", 3600)] * 6}], steps=6, H=3, param_bytes=3600,
                               tensors=6)
    with pytest.raises(AssertionError, match="one per parameter tensor"):
        expect_local_sgd_calls([{"ops": [op("all_reduce", 600)] * 12}], steps=6, H=3, param_bytes=3600,
                               tensors=6)


@exercise("async_sgd")
def test_server_traffic_in_schedule_order():
    group = (0, 1, 2)

    def p2p(*calls):
        return [op(name, 80, peer=peer, group=group) for name, peer in calls]

    server = p2p(("send", 1), ("recv", 1), ("send", 2), ("recv", 2), ("send", 1), ("recv", 1))
    workers = [p2p(("recv", 0), ("send", 0), ("recv", 0), ("send", 0)), p2p(("recv", 0), ("send", 0))]
    results = [{"ops": server}] + [{"ops": w} for w in workers]
    expect_server_traffic(results, updates=3, workers=2, param_bytes=80)
    swapped = [{"ops": p2p(("send", 2), ("recv", 2), ("send", 1), ("recv", 1), ("send", 2), ("recv", 2))}]
    with pytest.raises(AssertionError, match=r"update t is worker 1 \+ t mod 2's"):
        expect_server_traffic(swapped + results[1:], updates=3, workers=2, param_bytes=80)
