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
    with pytest.raises(AssertionError, match="8 bytes per index: send the indices as torch.int32"):
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


def test_topk_bytes_accept_every_all_gather_form_and_name_8_byte_indices():
    for form in ("all_gather_into_tensor", "all_gather_single"):
        expect_topk_bytes([{"ops": [op(form, 24), op(form, 12)]}], 3, 8, steps=1, numel=12)
    # an all-to-all sending every rank the same pairs: 1/N of its input to each (N = 2 here)
    spread = {"ops": [op("all_to_all_single", 48), op("all_to_all_single", 24)]}
    expect_topk_bytes([spread, spread], 3, 8, steps=1, numel=12)
    with pytest.raises(AssertionError, match="not cast to int64 or to the values' float dtype"):
        expect_topk_bytes([{"ops": [op("all_gather", 24), op("all_gather", 24)]}], 3, 8, steps=1, numel=12)


def test_a_residual_of_the_gradient_alone_is_named():
    grads = dyadic_gradients(2, 3, 12, seed=5)
    results = topk_results(grads, 3)
    old = [torch.zeros(12, dtype=grads[0][0].dtype) for _ in grads]
    for step in range(3):
        for rank in range(2):  # new residual = gradient - sent, where sent = top-k of gradient + old residual
            acc = grads[rank][step] + old[rank]
            new = results[rank]["residuals"][step]
            sent = acc - new
            results[rank]["residuals"][step] = grads[rank][step] - sent
            old[rank] = new
    with pytest.raises(AssertionError, match="the new residual is gradient - sent, so the old residual"):
        expect_topk_run(results, grads, 3)


def test_local_sgd_in_a_float32_buffer_is_named():
    with pytest.raises(AssertionError, match="the flat tensor is float32"):
        expect_local_sgd_calls([{"ops": [op("all_reduce", 1800)] * 2}], steps=6, H=3, param_bytes=3600,
                               tensors=6)


def powersgd_results(scale=1.0, rebound=False, lose_bias_error=False):
    """Two ranks, one step: fc0.weight (16 x 8) compressed at rank 1, fc0.bias not (as powersgd_run)."""
    g = torch.Generator().manual_seed(3)
    local = [{"fc0.weight": torch.randn(16, 8, generator=g, dtype=torch.float64),
              "fc0.bias": torch.randn(16, generator=g, dtype=torch.float64)} for _ in range(2)]
    mean = (local[0]["fc0.weight"] + local[1]["fc0.weight"]) / 2
    p_hat = torch.linalg.qr(mean @ torch.randn(8, 1, generator=g, dtype=torch.float64)).Q
    applied = {"fc0.weight": scale * p_hat @ (p_hat.T @ mean),
               "fc0.bias": (local[0]["fc0.bias"] + local[1]["fc0.bias"]) / 2}
    results = []
    for r in range(2):
        grads = dict(applied, **({"fc0.weight": local[r]["fc0.weight"]} if rebound else {}))
        errors = {name: local[r][name] - grads[name] for name in grads}
        if lose_bias_error:
            errors["fc0.bias"] = None
        results.append({"grads": [grads], "local": [local[r]], "errors_by_step": [errors]})
    return results


def test_powersgd_projection_error_feedback_and_rebinding_are_named():
    from dpcourse.topics.compression.checks import expect_error_feedback, expect_low_rank, expect_projection

    shapes = {"fc0.weight": (16, 8), "fc0.bias": (16,)}
    right = powersgd_results()
    expect_low_rank(right, shapes, 1)
    expect_error_feedback(right, shapes, 1)
    expect_projection(right, shapes, 1)
    with pytest.raises(AssertionError, match="2x the expected values.*divide it by N = 2"):
        expect_projection(powersgd_results(scale=2.0), shapes, 1)
    with pytest.raises(AssertionError, match="only rebinds the name M"):
        expect_low_rank(powersgd_results(rebound=True), shapes, 1)
    with pytest.raises(AssertionError, match="fc0.bias: state.errors has no entry .*travels uncompressed"):
        expect_error_feedback(powersgd_results(lose_bias_error=True), shapes, 1)


def async_results(delay, workers=2, updates=5, stale_apply=False, lag=0):
    """A server and its workers as async_run reports them, simulated here (lag: versions that late)."""
    from dpcourse.topics.compression.data import TASK_MODEL
    from dpcourse.topics.compression.runs import LR, async_batches, build_model
    from dpcourse.toys.models import loss_fn

    net = build_model(TASK_MODEL, 0)
    params = list(net.parameters())
    versions = [torch.cat([p.detach().reshape(-1) for p in params])]
    seen = {w: [] for w in range(1, workers + 1)}
    for t, (x, y) in enumerate(async_batches(updates, 4, 0)):
        at = versions[max(0, t - delay - lag)]
        with torch.no_grad():
            offset = 0
            for p in params:
                p.copy_(at[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        grad = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss_fn(net(x), y), params)])
        seen[1 + t % workers].append((at.clone(), x.clone()))
        versions.append((versions[max(0, t - delay)] if stale_apply else versions[-1]) - LR * grad)
    final, offset = {}, 0
    for name, p in net.named_parameters():
        final[name] = versions[-1][offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    return [{"state": final, "seen": []}] + [{"seen": seen[w]} for w in range(1, workers + 1)]


def test_async_schedule_names_a_stale_application_and_a_wrong_version():
    from dpcourse.topics.compression.checks import expect_async_schedule
    from dpcourse.topics.compression.data import TASK_MODEL

    expect_async_schedule(async_results(2), TASK_MODEL, 0, updates=5, per_update=4, delay=2)
    with pytest.raises(AssertionError, match="apply it to the latest version"):
        expect_async_schedule(async_results(2, stale_apply=True), TASK_MODEL, 0, updates=5, per_update=4,
                              delay=2)
    with pytest.raises(AssertionError, match="update 3 .worker 2. was computed at version 0; expected"):
        expect_async_schedule(async_results(2, lag=1), TASK_MODEL, 0, updates=5, per_update=4, delay=2)
