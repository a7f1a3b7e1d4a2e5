"""topics.zero.checks: results built from the reference itself pass; each known mistake, planted in
them, fails with the message that names it. (Runs on real ranks: tests/grader/test_tuned_zero.py.)"""

import copy
import math

import pytest
import torch

from dpcourse.comm.recorder import CommOp
from dpcourse.reference.splits import chunk_bounds
from dpcourse.topics.zero.checks import expect_fsdp, expect_zero1, expect_zero2, reference_of, unit_layout
from markers import exercise

MODEL, SEED, STEPS, PER_RANK, N = "deep_mlp", 3, 2, 2, 3
S = 994


def gather_ops(numel, n, steps, group):
    chunk = math.ceil(numel / n)
    return [CommOp("all_gather", None, chunk * 8, 0.0, 0.0, group) for _ in range(steps)]


@pytest.fixture(scope="module")
def ref():
    return reference_of(MODEL, SEED, STEPS, PER_RANK, N)


def zero1_results(ref):
    results = []
    for a, b in chunk_bounds(S, N):
        summary = {"numel": b - a, "storage_bytes": (b - a) * 8, "state_bytes": 2 * (b - a) * 8 + 4,
                   "state": {k: v[a:b].clone() for k, v in ref["optimizer"].items()}}
        results.append({"state": copy.deepcopy(ref["state"]), "optimizer": summary,
                        "ops": gather_ops(S, N, STEPS, tuple(range(N)))})
    return results


@exercise("sharded_optimizer")
def test_zero1_right_results_pass_and_mistakes_are_named(ref):
    expect_zero1(zero1_results(ref), MODEL, SEED, STEPS, PER_RANK)
    everything = zero1_results(ref)
    everything[0]["optimizer"]["numel"] = S
    with pytest.raises(AssertionError, match="steps all 994 elements"):
        expect_zero1(everything, MODEL, SEED, STEPS, PER_RANK)
    stale = zero1_results(ref)
    name = "fc3.weight"  # in rank 2's shard only
    stale[0]["state"][name] = reference_of(MODEL, SEED, 0, PER_RANK, N)["state"][name]
    with pytest.raises(AssertionError, match="still hold their initial values"):
        expect_zero1(stale, MODEL, SEED, STEPS, PER_RANK)
    swapped = zero1_results(ref)
    swapped[1]["optimizer"]["state"], swapped[2]["optimizer"]["state"] = (swapped[2]["optimizer"]["state"],
                                                                           swapped[1]["optimizer"]["state"])
    with pytest.raises(AssertionError, match="it is the state of chunk 2"):
        expect_zero1(swapped, MODEL, SEED, STEPS, PER_RANK)
    loud = zero1_results(ref)
    loud[2]["ops"] = [CommOp("all_reduce", None, S * 8, 0.0, 0.0, (0, 1, 2))] * STEPS
    with pytest.raises(AssertionError, match="rank 2: ShardedOptimizer: step.. sent 10603 bytes per step"):
        expect_zero1(loud, MODEL, SEED, STEPS, PER_RANK)


def zero2_results(ref, per_step=None):
    results = []
    for a, b in chunk_bounds(S, N):
        ops = [CommOp("reduce_scatter", None, S * 8, 0.0, 0.0, tuple(range(N)))] * STEPS
        results.append({"shards": [g[a:b].clone() for g in ref["grads"]], "held": [0] * STEPS, "ops": ops})
    return results


@exercise("reduce_scatter_gradients")
def test_zero2_right_results_pass_and_mistakes_are_named(ref):
    expect_zero2(zero2_results(ref), MODEL, SEED, STEPS, PER_RANK)
    summed = zero2_results(ref)
    summed[1]["shards"][0] = summed[1]["shards"][0] * N
    with pytest.raises(AssertionError, match="3 times the average"):
        expect_zero2(summed, MODEL, SEED, STEPS, PER_RANK)
    shifted = zero2_results(ref)
    a, b = chunk_bounds(S, N)[1]
    shifted[1]["shards"][0] = ref["grads"][0][a + 1:b + 1].clone()
    with pytest.raises(AssertionError, match="off by 1"):
        expect_zero2(shifted, MODEL, SEED, STEPS, PER_RANK)
    kept = zero2_results(ref)
    kept[0]["held"][1] = S
    with pytest.raises(AssertionError, match="still hold full gradients"):
        expect_zero2(kept, MODEL, SEED, STEPS, PER_RANK)


def fsdp_results(ref, n=N):
    layout, results, offset = unit_layout(MODEL, SEED), [], 0
    spans = []
    for _, params in layout:
        size = sum(k for _, k in params)
        spans.append((offset, offset + size))
        offset += size
    chunks = [math.ceil((hi - lo) / n) for lo, hi in spans]
    group = tuple(range(n))
    ops = [CommOp("all_gather", None, c * 8, 0.0, 0.0, group) for c in chunks] * 2
    ops += [CommOp("reduce_scatter", None, c * n * 8, 0.0, 0.0, group) for c in chunks]
    for r in range(n):
        shards, grads = [], []
        for lo, hi in spans:
            a, b = chunk_bounds(hi - lo, n)[r]
            shards.append(ref["params"][lo + a:lo + b].clone())
            grads.append(ref["grads"][0][lo + a:lo + b].clone())
        events = [("mark", "built", False, 0.0)]
        for name, _ in layout:
            events += [("alloc", name, False, 0.0), ("free", name, False, 0.0)]
        results.append({"units": [name for name, _ in layout], "shards": shards, "grads": grads, "frozen": {},
                        "events": events, "ops": ops * STEPS, "group_rank": r, "group_size": n,
                        "held": {"weights": sum(s.numel() for s in shards) * 8,
                                 "gradients": sum(s.numel() for s in shards) * 8, "optimizer": 0}})
    return results


@exercise("mini_fsdp")
def test_fsdp_right_results_pass_and_mistakes_are_named(ref):
    expect_fsdp(fsdp_results(ref), MODEL, SEED, STEPS, PER_RANK)
    whole = fsdp_results(ref)
    never_freed = [("alloc", unit, False, 0.0) for unit in whole[1]["units"]]
    whole[1]["events"] = [("mark", "built", False, 0.0), *never_freed]
    with pytest.raises(AssertionError, match="rank 1: MiniFSDP: 5 units were unsharded at once.*in forward"):
        expect_fsdp(whole, MODEL, SEED, STEPS, PER_RANK)
    kept = fsdp_results(ref)
    kept[2]["held"]["weights"] = S * 8
    with pytest.raises(AssertionError, match="holds 7952 bytes of weights between steps"):
        expect_fsdp(kept, MODEL, SEED, STEPS, PER_RANK)
    loud = fsdp_results(ref)
    loud[0]["ops"] = loud[0]["ops"] + [CommOp("all_reduce", None, S * 8, 0.0, 0.0, (0, 1, 2))] * STEPS
    with pytest.raises(AssertionError, match="expected 3.N-1./N·S"):
        expect_fsdp(loud, MODEL, SEED, STEPS, PER_RANK)
    summed = fsdp_results(ref)
    summed[0]["grads"][2] = summed[0]["grads"][2] * N
    with pytest.raises(AssertionError, match="unit fc2, after the first backward.*3 times the average"):
        expect_fsdp(summed, MODEL, SEED, STEPS, PER_RANK)
    assert torch.equal(fsdp_results(ref)[0]["shards"][0], ref["params"][:48])


def test_zero1_explicit_shard_and_the_gather_are_judged_by_what_they_show(ref):
    ignored = zero1_results(ref)
    ignored[1]["step_error"] = "AttributeError: 'NoneType' object has no attribute 'reshape'"
    with pytest.raises(AssertionError, match="rank 1: .*must step with that argument, not with the .grads"):
        expect_zero1(ignored, MODEL, SEED, STEPS, PER_RANK)
    shards = [ref["params"][a:b].clone() for a, b in chunk_bounds(S, N)]
    joined = zero1_results(ref)  # the optimizers hold the right shards; the gather kept each piece's padding
    padded = torch.cat([torch.cat([s, s.new_zeros(332 - s.numel())]) for s in shards])[:S]
    for r, result in enumerate(joined):
        result["optimizer"]["values"] = shards[r]
    offset = 0
    for name in [n for n, _ in ref["names"]]:
        k = ref["state"][name].numel()
        joined[0]["state"][name] = padded[offset:offset + k].view_as(ref["state"][name]).clone()
        offset += k
    with pytest.raises(AssertionError, match="element 663, rank 2's shard.*joined with their padding"):
        expect_zero1(joined, MODEL, SEED, STEPS, PER_RANK)


def test_fsdp_gathers_are_judged_before_gradients_and_accumulation_is_named(ref):
    start = reference_of(MODEL, SEED, 0, PER_RANK, N)["params"]
    gathered = fsdp_results(ref)
    lo, hi = 3 * 272 + 144, S  # head: 34 elements, shards of 12, 11, 11
    pieces = [start[lo + a:lo + b] for a, b in chunk_bounds(hi - lo, N)]
    for result in gathered:
        result["gathered"] = [None] * 4 + [torch.cat([torch.cat([p, p.new_zeros(12 - p.numel())])
                                                      for p in pieces])[:34]]
    gathered[0]["grads"][0] = gathered[0]["grads"][0] * 2  # a later consequence: not what is reported
    with pytest.raises(AssertionError, match="unit head, as gathered for its first forward, is not every "
                                             "rank's shard side by side.*joined with their padding"):
        expect_fsdp(gathered, MODEL, SEED, STEPS, PER_RANK)
    accumulated = fsdp_results(ref)
    for result in accumulated:
        result["accumulate"] = 2
    expect_fsdp(accumulated, MODEL, SEED, STEPS, PER_RANK)  # twice the passes, twice the bytes: allowed
    from dpcourse.topics.zero.checks import _last_part
    last = _last_part(MODEL, SEED, STEPS, PER_RANK, N, 2)
    a, b = chunk_bounds(144, N)[0]
    accumulated[0]["grads"][0] = last[a:b].clone()
    with pytest.raises(AssertionError, match="the last backward's gradient alone.*add the reduce-scattered"):
        expect_fsdp(accumulated, MODEL, SEED, STEPS, PER_RANK)
