"""Checks the visible test cells use: run a function on ranks, compare rank by rank.

Every failure says which rank, what it returned and what was expected, so a
learner reads the fix off the message instead of a bare `assert`.
"""

import torch
import torch.distributed as dist

from .launcher import launch


def call_with_rank_input(fn, inputs):
    """Rank r calls fn(*inputs[r]): how a test hands each rank its own data."""
    return fn(*inputs[dist.get_rank()])


def run_per_rank(fn, inputs, **launch_options):
    """Launch len(inputs) ranks; rank r runs fn(*inputs[r]). Returns the per-rank results."""
    inputs = [tuple(i) if isinstance(i, (tuple, list)) else (i,) for i in inputs]
    return launch(call_with_rank_input, len(inputs), fn, inputs, **launch_options)


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


def expect_per_rank(results, expected, what, atol=0.0, rtol=0.0):
    """Compare the per-rank results of a launch with the expected value for each rank."""
    if len(results) != len(expected):
        raise AssertionError(f"{len(results)} ranks returned a result, expected {len(expected)}")
    for rank, (got, want) in enumerate(zip(results, expected, strict=True)):
        expect_equal(got, want, what, rank=rank, atol=atol, rtol=rtol)
