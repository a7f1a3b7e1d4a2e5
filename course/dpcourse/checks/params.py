"""Compare gradients, parameters and whole model states with a reference, and say *how* they differ.

Used by the test cells of notebooks 01 (gradients and parameters against float64 single-process
math) and 05 (a DDP rank's state against one process trained on the same global batches), and by
their hidden checks.

Data-parallel bugs have signatures: summing instead of averaging makes every gradient N times too
big, an update applied twice moves parameters twice as far, a gradient read before its all-reduce
finished is the local one divided by N, a replica that never synchronises drifts away from the
others. Each check recognises the signature it can see and names it, on top of the comparison core
(dpcourse.checks.core: one message style, one tolerance table).
"""

import torch

from dpcourse.checks.core import (
    TOLERANCES,
    describe,
    expect_close,
    float_hint,
    is_close,
    known_mistake,
    rank_prefix,
    ratio_hint,
    shorten,
    tolerance,
)
from dpcourse.reference.training import strip_module_prefix


def expect_same_state(got, expected, what, rank=None, atol=None, rtol=None, hint=""):
    """Compare two states ({name: tensor}, e.g. state_dicts) entry by entry; name the first that differs.

    A DDP model's 'module.' prefix is ignored. Tolerance: the table's for the dtypes, or atol/rtol
    (atol alone: an absolute bound; atol=0: bit for bit). `hint` ends the message on a mismatch of values.
    """
    where = rank_prefix(rank)
    if not isinstance(got, dict):
        raise AssertionError(f"{where}{what} should be a state_dict (a dict of tensors), got "
                             f"{type(got).__name__}")
    got, expected = strip_module_prefix(got), strip_module_prefix(expected)
    if set(got) != set(expected):
        entries = [f"[{shorten(sorted(state), 6, more='...')}]" for state in (got, expected)]
        raise AssertionError(f"{where}{what} has entries {entries[0]}, expected {entries[1]} (return "
                             f"model.module.state_dict())")
    for name, want in expected.items():
        have = got[name]
        if not isinstance(have, torch.Tensor):
            raise AssertionError(f"{where}{what}: {name} is {describe(have)[:200]}, expected a tensor of "
                                 f"shape {tuple(want.shape)}")
        have = have.detach().cpu()
        if have.shape != want.shape:
            raise AssertionError(f"{where}{what}: {name} has shape {tuple(have.shape)}, expected "
                                 f"{tuple(want.shape)}")
        if not is_close(have, want, atol=atol, rtol=rtol):
            gap = ""
            if want.is_floating_point() and want.numel():
                gap = f" (largest difference {(have.double() - want.double()).abs().max().item():.3g})"
            raise AssertionError(f"{where}{what}: {name} is {describe(have)}, expected {describe(want)}{gap}"
                                 f"{float_hint(have, want)}" + (f" ({hint})" if hint else ""))


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


def expect_averaged_gradients(got, average, local, world_size, what, rank=None,
                              atol=TOLERANCES["float64 absolute"][0]):
    """Assert each gradient `got` equals the global `average`; if not, say what it looks like instead.

    `local` holds this rank's own gradients (its shard only): a gradient that equals
    them was never all-reduced, one that is N times the average was summed and not
    divided, one that is local/N was divided but the all-reduce had not finished.
    """
    where = rank_prefix(rank)

    def close(a, b):
        return is_close(a, b, atol=atol)

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


def expect_gradients(got, expected, names, what, suspects=None):
    """A list of gradients (one per parameter, in order) against the reference list.
    suspects: {hint: a known wrong list of gradients}; a mismatch that matches one ends with its hint."""
    if not isinstance(got, (list, tuple)) or len(got) != len(expected):
        raise AssertionError(f"{what}: expected a list of {len(expected)} gradient tensors (one per "
                             f"parameter), got {describe(got)[:200]}")
    for name, g, e in zip(names, got, expected, strict=True):
        if isinstance(g, torch.Tensor) and g.shape == e.shape and is_close(g, e):
            continue
        expect_close(g, e, f"{what}, the gradient of {name}", hint=known_mistake(got, suspects))


def expect_parameters(got, expected, names, start, what):
    """Parameters after training against the reference; `start` (the parameters before training)
    lets the message say how far they moved compared with the reference update."""
    got = list(got)
    if len(got) != len(expected):
        raise AssertionError(f"{what}: {len(got)} parameters, expected {len(expected)}")
    for name, g, e, s in zip(names, got, expected, start, strict=True):
        atol, rtol = tolerance(g.dtype, e.dtype)
        g = g.detach().cpu().double()
        e, s = e.detach().cpu().double(), s.detach().cpu().double()
        if g.shape != e.shape:
            raise AssertionError(f"{what}: {name} has shape {tuple(g.shape)}, expected {tuple(e.shape)}")
        if not is_close(g, e, atol=atol, rtol=rtol):
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
