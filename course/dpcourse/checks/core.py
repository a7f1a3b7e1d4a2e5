"""Compare gradients and trained parameters with a float64 reference, and say *how* they differ.

Data-parallel bugs have signatures: summing instead of averaging makes every
gradient N times too big, an update applied twice moves parameters twice as
far, a replica that never synchronises drifts away from the others. These
checks recognise a result that is a multiple of the expected one and say so
("4x the expected values"), which points at the bug faster than two lists of
numbers.
"""

import torch


def describe(value, limit=8):
    """A short, readable rendering of a value for a failure message."""
    if isinstance(value, torch.Tensor):
        flat = value.detach().flatten()
        shown = ", ".join(f"{v:g}" for v in flat[:limit].tolist())
        more = f", … ({flat.numel()} values)" if flat.numel() > limit else ""
        return f"tensor([{shown}{more}], shape={tuple(value.shape)}, dtype={str(value.dtype)[6:]})"
    return repr(value)


def expect_equal(got, expected, what, rank=None, atol=0.0, rtol=0.0):
    """Assert got == expected (tensors: same shape, values within tolerance), explaining a mismatch."""
    where = f"rank {rank}: " if rank is not None else ""
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"{where}{what} should be a tensor, got {describe(got)}")
        if got.shape != expected.shape:
            raise AssertionError(f"{where}{what} has shape {tuple(got.shape)}, expected "
                                 f"{tuple(expected.shape)}: got {describe(got)}, expected "
                                 f"{describe(expected)}")
        if not torch.allclose(got.to(expected.dtype), expected, atol=atol, rtol=rtol):
            raise AssertionError(f"{where}{what} is {describe(got)}, expected {describe(expected)}")
    elif got != expected:
        raise AssertionError(f"{where}{what} is {describe(got)}, expected {describe(expected)}")


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
