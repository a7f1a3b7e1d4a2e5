"""Small models, generated data and the single-process reference that DDP exercises are checked against.

The one fact behind every DDP check: N ranks that start from the same model, each
run backward on its own shard of a global batch and average their gradients,
take exactly the step one process takes on the whole global batch. So a DDP
implementation is correct when, after several steps, its parameters equal those
of `train_single_process` on the same global batches -- parameter by parameter.

Why float64 by default: averaging N shard means and taking one mean over the
global batch add numbers in different orders. In float32 the two differ by
~1e-7 and the difference grows with steps; in float64 it stays near 1e-15, so a
tolerance of 1e-9 separates "right" from "wrong by a factor of N" with no doubt.

Why generated data: no downloads, and every rank (and the reference) can rebuild
exactly the same tensors from a seed.
"""

import torch

from dpcourse.checks.core import ATOL, RTOL, describe, expect_close, ratio_hint


def expect_same_state(got, expected, what, rank=None, atol=1e-9):
    """Assert two states hold the same tensors (within atol); name the first tensor that differs."""
    where = f"rank {rank}: " if rank is not None else ""
    missing = [name for name in expected if name not in got]
    if missing:
        raise AssertionError(f"{where}{what}: no tensor named {missing[0]!r}")
    for name, want in expected.items():
        have = got[name]
        if have.shape != want.shape:
            raise AssertionError(f"{where}{what}: {name} has shape {tuple(have.shape)}, expected "
                                 f"{tuple(want.shape)}")
        if want.is_floating_point():
            diff = (have.double() - want.double()).abs().max().item() if want.numel() else 0.0
            ok = diff <= atol
        else:
            diff, ok = None, torch.equal(have, want)
        if not ok:
            how_far = f" (largest difference {diff:.3g})" if diff is not None else ""
            raise AssertionError(f"{where}{what}: {name} is {describe(have)}, expected "
                                 f"{describe(want)}{how_far}")


def expect_identical_across_ranks(states, what="parameters"):
    """Assert every rank's state equals rank 0's exactly (bit for bit)."""
    for rank, state in enumerate(states[1:], start=1):
        for name, tensor in states[0].items():
            if not torch.equal(state[name], tensor):
                diff = (state[name].double() - tensor.double()).abs().max().item()
                raise AssertionError(f"rank {rank}'s {what} differ from rank 0's: {name} differs by "
                                     f"up to {diff:.3g} (ranks must stay identical)")


def _is_zero_or_none(tensor):
    return tensor is None or not tensor.any()


def expect_averaged_gradients(got, average, local, world_size, what, rank=None, atol=1e-9):
    """Assert each gradient `got` equals the global `average`; if not, say what it looks like instead.

    `local` holds this rank's own gradients (its shard only): a gradient that equals
    them was never all-reduced, one that is N times the average was summed and not
    divided, one that is local/N was divided but the all-reduce had not finished.
    """
    where = f"rank {rank}: " if rank is not None else ""
    close = lambda a, b: a.shape == b.shape and (a.double() - b.double()).abs().max().item() <= atol
    for name, want in average.items():
        have = got.get(name)
        if want is None:
            if not _is_zero_or_none(have):
                raise AssertionError(f"{where}{what}: {name} gets no gradient in one process, but has "
                                     f"{describe(have)}")
            continue
        if have is None:
            raise AssertionError(f"{where}{what}: {name} has no gradient (expected {describe(want)})")
        if close(have, want):
            continue
        hint = "is not the average over ranks"
        if close(have, want * world_size):
            hint = (f"is {world_size} times the average over ranks: all_reduce sums, so divide by the "
                    f"world size")
        elif local.get(name) is not None and close(have, local[name]):
            hint = "is still this rank's local gradient: it was not all-reduced (a parameter skipped?)"
        elif local.get(name) is not None and close(have, local[name] / world_size):
            hint = (f"is this rank's local gradient divided by {world_size}: the all-reduce had not "
                    f"finished (or was not waited for) when the gradient was read")
        raise AssertionError(f"{where}{what}: the gradient of {name} {hint}. Got {describe(have, 4)}, "
                             f"expected {describe(want, 4)}")


def expect_gradients(got, expected, names, what):
    """A list of gradients (one per parameter, in order) against the reference list."""
    if not isinstance(got, (list, tuple)) or len(got) != len(expected):
        raise AssertionError(f"{what}: expected a list of {len(expected)} gradient tensors (one per "
                             f"parameter), got {describe(got)[:200]}")
    for name, g, e in zip(names, got, expected, strict=True):
        expect_close(g, e, f"{what}, the gradient of {name}")


def expect_parameters(got, expected, names, start, what):
    """Parameters after training against the reference; `start` (the parameters before training)
    lets the message say how far they moved compared with the reference update."""
    got = list(got)
    if len(got) != len(expected):
        raise AssertionError(f"{what}: {len(got)} parameters, expected {len(expected)}")
    for name, g, e, s in zip(names, got, expected, start, strict=True):
        g = g.detach().cpu().double()
        e, s = e.detach().cpu().double(), s.detach().cpu().double()
        if g.shape != e.shape:
            raise AssertionError(f"{what}: {name} has shape {tuple(g.shape)}, expected {tuple(e.shape)}")
        if not torch.allclose(g, e, atol=ATOL, rtol=RTOL):
            hint = ""
            if torch.equal(g, s):
                hint = " (it did not move at all)"
            elif ratio_hint(g - s, e - s):
                hint = ratio_hint(g - s, e - s).replace("(", "(the update is ").replace(
                    "expected values", "reference update")
            raise AssertionError(f"{what}: {name} is {describe(g.float())}, expected "
                                 f"{describe(e.float())}{hint}")


def expect_replicas_equal(replicas, names, what):
    """Every replica's parameters must be bit-identical to replica 0's."""
    first = [p.detach() for p in replicas[0].parameters()]
    for k, replica in enumerate(replicas[1:], start=1):
        for name, p, p0 in zip(names, replica.parameters(), first, strict=True):
            if not torch.equal(p.detach(), p0):
                raise AssertionError(f"{what}: replica {k}'s {name} differs from replica 0's "
                                     f"({describe(p.detach())} vs {describe(p0)}): every replica must "
                                     f"apply the same averaged gradient")


def expect_shard_calls(sizes, expected_sizes, what):
    """The batch sizes a RecordingLoss saw must be one call per non-empty shard (any order)."""
    want = [s for s in expected_sizes if s > 0]
    if sorted(s for s in sizes if s > 0) != sorted(want):
        raise AssertionError(f"{what}: the loss was computed on batches of sizes {list(sizes)}, expected "
                             f"one call per non-empty shard, of sizes {want}")
