"""Checks the visible test cells use: run a function on ranks, compare rank by rank.

Used by the test cells of notebooks 00, 01 and 03 and the hidden checks of 00
(`run_per_rank_recorded` / `expect_calls`: 00's "a single all-reduce").

Every failure says which rank, what it returned and what was expected, so a
learner reads the fix off the message instead of a bare `assert`.
"""

from dpcourse.checks.core import expect_equal
from dpcourse.comm.recorder import CommOp, recorded
from dpcourse.runtime.launcher import launch, observed_traffic, per_rank


def call_with_rank_input(fn, mine):
    """Rank r calls fn(*inputs[r]): how a test hands each rank its own data (launched with
    per_rank(inputs), so rank r receives inputs[r] only, never its peers')."""
    return fn(*mine)


def run_per_rank(fn, inputs, **launch_options):
    """Launch len(inputs) ranks; rank r runs fn(*inputs[r]). Returns the per-rank results."""
    inputs = [tuple(i) if isinstance(i, (tuple, list)) else (i,) for i in inputs]
    return launch(call_with_rank_input, len(inputs), fn, per_rank(inputs), **launch_options)


def call_recorded_with_rank_input(fn, mine):
    """Rank r calls fn(*inputs[r]) under a CommRecorder: (its result, its calls as plain lists)."""
    result, ops = recorded(fn, *mine)
    return result, [[o.op, o.peer, o.nbytes, o.start, o.end, o.group] for o in ops]


def run_per_rank_recorded(fn, inputs, **launch_options):
    """run_per_rank, and what each rank said: a list of (result, [CommOp, ...]), one per rank.

    Why: a rule like "a single all-reduce" is judged from the calls. While graded they are the
    router's own record of the launch (`observed_traffic`), which the learner's code cannot
    touch; in a notebook, each rank's recorder reports them.
    """
    inputs = [tuple(i) if isinstance(i, (tuple, list)) else (i,) for i in inputs]
    results = launch(call_recorded_with_rank_input, len(inputs), fn, per_rank(inputs), **launch_options)
    traffic = observed_traffic()
    return [(result, list(traffic[rank]) if traffic is not None else [CommOp(*fields) for fields in ops])
            for rank, (result, ops) in enumerate(results)]


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
