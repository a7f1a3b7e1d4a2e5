"""Hidden checks of 00_orientation. Each raises a short AssertionError saying what is wrong."""

import torch
import torch.distributed as dist

from dpcourse import launch
from dpcourse.checks.core import expect_equal
from dpcourse.checks.ranks import expect_calls, expect_per_rank
from dpcourse.comm.recorder import CommOp, recorded
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
        results = launch(_mean_and_input_after, len(shards), global_mean, shards)
        for rank, (got, x_after, _) in enumerate(results):
            if not isinstance(got, float):
                raise AssertionError(f"global_mean should return a Python float, rank {rank} "
                                     f"returned {type(got).__name__}")
            if abs(got - expected) > 1e-9 * max(1.0, abs(expected)):
                raise AssertionError(f"rank {rank}: global_mean with {name} is {got!r}, expected "
                                     f"{expected!r}{mean_hint(got, expected)}")
            expect_equal(x_after, shards[rank], "the input x after global_mean (it must not be "
                         "modified)", rank=rank)
        traffic = observed_traffic()
        ops = [list(traffic[r]) if traffic is not None else [CommOp(*f) for f in fields]
               for r, (_, _, fields) in enumerate(results)]
        expect_calls(ops, "all_reduce", 1, f"global_mean with {name}", advice=ONE_ALL_REDUCE)


ONE_ALL_REDUCE = (": put the sum and the count in one float64 tensor and all-reduce it once (every "
                  "all-reduce pays the network's latency once)")


def mean_hint(got, expected):
    """' (a rounding-sized gap: accumulate in float64 ...)' when got misses by float32 rounding only."""
    if expected and abs(got - expected) <= 1e-5 * abs(expected):
        return (" (off by rounding only: accumulate in float64 -- x.double().sum() -- float32 keeps about 7 "
                "digits, and a sum of 1000 values loses some of them)")
    return ""


def _mean_and_input_after(global_mean, shards):
    """Runs on each rank: the learner's result, the rank's input as the call left it, its calls."""
    x = shards[dist.get_rank()].clone()
    result, ops = recorded(global_mean, x)
    return result, x, [[o.op, o.peer, o.nbytes, o.start, o.end, o.group] for o in ops]
