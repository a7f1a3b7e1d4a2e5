"""Checks the visible test cells use: run a function on ranks, compare rank by rank.

Used by the test cells of notebooks 00, 01 and 03 and the hidden checks of 00
(`run_per_rank_recorded` / `expect_calls`: 00's "a single all-reduce"), on the case runner
(dpcourse.comm.cases): each rank is sent its own inputs only.

Every failure says which rank, what it returned and what was expected, so a
learner reads the fix off the message instead of a bare `assert`.
"""

from dpcourse.checks.core import expect_equal
from dpcourse.comm.cases import Case, run_cases
from dpcourse.runtime.timeouts import TIMEOUTS


def call_with_own_arguments(fn, mine, ctx):
    """Rank side (the case runner's per-case function): rank r calls fn(*inputs[r]), sent inputs[r]
    only, never its peers'."""
    return {"result": fn(*mine)}


def _runs(fn, inputs, group_timeout=None, deadline=None, keep_messages=None):
    inputs = [tuple(i) if isinstance(i, (tuple, list)) else (i,) for i in inputs]
    name = getattr(fn, "name", None) or getattr(fn, "__name__", "your function")  # the judge's stand-ins
    return run_cases(call_with_own_arguments, fn, len(inputs), [Case(parts=inputs)], exercise=name,
                     group_timeout=TIMEOUTS["group"] if group_timeout is None else group_timeout,
                     deadline=deadline, keep_messages=keep_messages)[0]


def run_per_rank(fn, inputs, group_timeout=None, deadline=None):
    """Launch len(inputs) ranks; rank r runs fn(*inputs[r]). Returns the per-rank results."""
    return [run.result for run in _runs(fn, inputs, group_timeout, deadline)]


def run_per_rank_recorded(fn, inputs, group_timeout=None, deadline=None):
    """run_per_rank, and what each rank said: a list of (result, [CommOp, ...]), one per rank.

    Why: a rule like "a single all-reduce" is judged from the calls. While graded they are the
    router's own record of the launch, which the learner's code cannot touch; in a notebook, each
    rank's recorder reports them (dpcourse.comm.cases).
    """
    return [(run.result, run.ops) for run in _runs(fn, inputs, group_timeout, deadline)]


def expect_calls(ops_per_rank, op, count, what, advice=""):
    """Every rank issued exactly `count` calls of the collective `op` ("all_reduce", ...)."""
    for rank, ops in enumerate(ops_per_rank):
        n = sum(1 for o in ops if o.op == op)
        if n != count:
            others = sorted({o.op for o in ops if o.op != op})
            also = f" (and {', '.join(others)})" if others else ""
            raise AssertionError(f"rank {rank}: {what} called dist.{op} {n} time{'s' if n != 1 else ''}"
                                 f"{also}, expected {count}{advice}")


def expect_per_rank(results, expected, what, atol=0.0, rtol=0.0):
    """Compare the per-rank results of a launch with the expected value for each rank."""
    if len(results) != len(expected):
        raise AssertionError(f"{len(results)} ranks returned a result, expected {len(expected)}")
    for rank, (got, want) in enumerate(zip(results, expected, strict=True)):
        expect_equal(got, want, what, rank=rank, atol=atol, rtol=rtol)
