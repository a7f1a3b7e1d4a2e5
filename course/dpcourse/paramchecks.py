"""Compare gradients and trained parameters with a float64 reference, and say *how* they differ.

Data-parallel bugs have signatures: summing instead of averaging makes every
gradient N times too big, an update applied twice moves parameters twice as
far, a replica that never synchronises drifts away from the others. These
checks recognise a result that is a multiple of the expected one and say so
("4x the expected values"), which points at the bug faster than two lists of
numbers.
"""

import torch

from .checks import describe

ATOL, RTOL = 2e-5, 1e-4


def ratio_hint(got, expected):
    """' (4x the expected values)' when `got` is a multiple (other than 1) of `expected`, else ''."""
    got, expected = got.detach().double().flatten().cpu(), expected.detach().double().flatten().cpu()
    denominator = float(expected @ expected)
    if denominator < 1e-18 or got.shape != expected.shape:
        return ""
    c = float(got @ expected) / denominator
    if abs(c - 1) > 1e-3 and (got - c * expected).norm() <= 1e-3 * (c * expected).norm():
        return f" ({c:.3g}x the expected values)"
    return ""


def expect_close(got, expected, what, atol=ATOL, rtol=RTOL):
    """Assert tensor `got` is close to `expected` (any dtype, any device), explaining a mismatch."""
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{what} should be a tensor, got {describe(got)[:200]}")
    got = got.detach().cpu()
    if got.shape != expected.shape:
        raise AssertionError(f"{what} has shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
    if got.is_floating_point() and not torch.isfinite(got).all():
        raise AssertionError(f"{what} contains nan or inf: {describe(got)} (a division by an empty "
                             f"shard's size, or by a zero variance?)")
    if not torch.allclose(got.double(), expected.double().cpu(), atol=atol, rtol=rtol):
        raise AssertionError(f"{what} is {describe(got)}, expected {describe(expected)}"
                             f"{ratio_hint(got, expected)}")


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
