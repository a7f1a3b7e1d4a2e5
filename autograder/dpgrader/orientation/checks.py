"""Hidden checks of 00_orientation. Each raises a short AssertionError saying what is wrong."""

import torch

from dpcourse import launch
from dpcourse.checks.core import expect_equal
from dpcourse.checks.ranks import expect_calls, expect_per_rank
from dpcourse.comm.cases import Case, run_cases
from dpcourse.runtime.launcher import observed_traffic

# What each exercise's expected values come from (autograder/exercises.json lists them).
REFERENCES = {
    "my_slice": "index arithmetic in the check: rows i of the data with i % N == r",
    "global_mean": "the float64 mean of all ranks' shards concatenated, computed in the check; one "
                   "all_reduce per rank, counted from the calls",
}


def check_my_slice(my_slice):
    for length, world in [(10, 3), (3, 4), (7, 1), (13, 5), (1, 2)]:
        data = torch.arange(100, 100 + length)
        expected = [data[[i for i in range(length) if i % world == r]] for r in range(world)]
        expect_per_rank(launch(my_slice, world, data), expected,
                        what=f"my_slice of {length} samples over {world} ranks")


def check_global_mean(global_mean):
    cases = {
        "shards of lengths 5, 1, 3": [torch.arange(5.0), torch.tensor([100.0]), torch.ones(3)],
        "an empty shard on rank 1": [torch.tensor([2.0, 4.0]), torch.tensor([])],
        "a single rank": [torch.tensor([1.5, 2.5, 3.5])],
        "1000 float32 values of 0.1 (sums need float64)": [torch.full((600,), 0.1),
                                                            torch.full((400,), 0.1)],
    }
    for name, shards in cases.items():
        expected = torch.cat(shards).double().mean().item()
        # graded: the router keeps what each all_reduce carried
        runs = run_cases(_mean_and_input_after, global_mean, len(shards), [Case(parts=shards, label=name)],
                         exercise="global_mean", keep_messages=True)[0]
        for run in runs:
            got, rank = run.result, run.rank
            if not isinstance(got, float):
                raise AssertionError(f"global_mean should return a Python float, rank {rank} "
                                     f"returned {type(got).__name__}")
            if abs(got - expected) > 1e-9 * max(1.0, abs(expected)):
                raise AssertionError(f"rank {rank}: global_mean with {name} is {got!r}, expected "
                                     f"{expected!r}{mean_hint(got, expected)}")
            expect_equal(run.after, shards[rank], "the input x after global_mean (it must not be "
                         "modified)", rank=rank)
        ops = [run.ops for run in runs]
        expect_calls(ops, "all_reduce", 1, f"global_mean with {name}", advice=ONE_ALL_REDUCE)
        if observed_traffic() is not None:
            expect_own_sum_and_count(ops, shards, f"global_mean with {name}")


def expect_own_sum_and_count(traffic, shards, what):
    """Each rank's all_reduce carried its own shard's sum and count (as the router received it): a
    rank that sends anything else (zeros) cannot have taken its mean from the all-reduce."""
    for rank, (ops, shard) in enumerate(zip(traffic, shards, strict=True)):
        carried = [t.double().reshape(-1) for o in ops if o.op == "all_reduce"
                   for t in getattr(o, "payload", [])]
        values = torch.cat(carried) if carried else torch.zeros(0, dtype=torch.float64)
        total, count = shard.double().sum().item(), float(shard.numel())
        has = [any(abs(v - want) <= 1e-9 * max(1.0, abs(want)) for v in values.tolist())
               for want in (total, count)]
        if not all(has):
            raise AssertionError(
                f"rank {rank}: {what}: its all_reduce carried {values.tolist()[:6]}, which does not hold "
                f"this rank's own sum ({total:g}) and count ({count:g}): every rank must all-reduce its "
                f"shard's sum and count, and take the mean from what comes back")


ONE_ALL_REDUCE = (": put the sum and the count in one float64 tensor and all-reduce it once (every "
                  "all-reduce pays the network's latency once)")


def mean_hint(got, expected):
    """' (a rounding-sized gap: accumulate in float64 ...)' when got misses by float32 rounding only."""
    if expected and abs(got - expected) <= 1e-5 * abs(expected):
        return (" (off by rounding only: accumulate in float64 -- x.double().sum() -- float32 keeps about 7 "
                "digits, and a sum of 1000 values loses some of them)")
    return ""


def _mean_and_input_after(global_mean, shard, ctx):
    """Rank side (the case runner's per-case function), sent its own shard only: the learner's result
    and the rank's input as the call left it."""
    x = shard.clone()
    return {"result": global_mean(x), "after": x}
