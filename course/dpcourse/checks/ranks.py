"""Checks the visible test cells use: run a function on ranks, compare rank by rank.

Used by the test cells of notebooks 00, 01 and 03 and the hidden checks of 00.

Every failure says which rank, what it returned and what was expected, so a
learner reads the fix off the message instead of a bare `assert`.
"""

import torch.distributed as dist

from dpcourse.checks.core import expect_equal
from dpcourse.runtime.launcher import launch


def call_with_rank_input(fn, inputs):
    """Rank r calls fn(*inputs[r]): how a test hands each rank its own data."""
    return fn(*inputs[dist.get_rank()])


def run_per_rank(fn, inputs, **launch_options):
    """Launch len(inputs) ranks; rank r runs fn(*inputs[r]). Returns the per-rank results."""
    inputs = [tuple(i) if isinstance(i, (tuple, list)) else (i,) for i in inputs]
    return launch(call_with_rank_input, len(inputs), fn, inputs, **launch_options)


def expect_per_rank(results, expected, what, atol=0.0, rtol=0.0):
    """Compare the per-rank results of a launch with the expected value for each rank."""
    if len(results) != len(expected):
        raise AssertionError(f"{len(results)} ranks returned a result, expected {len(expected)}")
    for rank, (got, want) in enumerate(zip(results, expected, strict=True)):
        expect_equal(got, want, what, rank=rank, atol=atol, rtol=rtol)
