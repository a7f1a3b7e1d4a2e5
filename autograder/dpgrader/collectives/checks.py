"""Hidden checks of 03_collectives. Each raises a short AssertionError saying what is wrong.

Every learner function runs under the recorder with p2p_only=True (a collective, or the
process-group bypass, fails the check), with a 3 s group timeout (a deadlock is reported
in seconds, naming ranks and calls). Expected values come from the inputs themselves or
from float64 sums on this side, never from a solution.
"""

import torch

from dpcourse.checks.core import expect_equal
from dpcourse.comm.p2p import run_p2p_cases
from dpcourse.comm.traffic import expect_tree_messages
from dpcourse.topics.collectives.checks import (
    expect_from,
    expect_gathered,
    expect_new_tensor,
    expect_same_bits,
    expect_unchanged,
)

# What each exercise's expected values come from (autograder/exercises.json lists them).
REFERENCES = {
    "ring_shift": "the inputs themselves: rank r ends with rank r-1's tensor, sent in one message",
    "naive_all_reduce": "the float64 sum of every rank's input, computed in the check",
    "p2p_broadcast": "the source rank's input; a tree's message counts (at most ⌈log2 N⌉ sends a rank)",
    "p2p_all_gather": "every rank's input, in rank order; at most (N-1)·|x| bytes sent a rank",
}


def _inputs(world, kind, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "float":
        return [torch.arange(3, dtype=torch.float32) + 10 * r for r in range(world)]
    if kind == "int2d":
        return [torch.arange(6, dtype=torch.int64).reshape(2, 3) * (r + 1) - 7 for r in range(world)]
    if kind == "random64":
        return [torch.randn(5, 3, generator=g, dtype=torch.float64) for _ in range(world)]
    if kind == "random32":
        return [torch.randn(17, generator=g) for _ in range(world)]
    if kind == "one":
        return [torch.tensor([float(r + 1)]) for r in range(world)]
    raise ValueError(kind)


def _cases(world, kinds, seed=0, **extra):
    return [dict(inputs=_inputs(world, kind, seed + i), label=f"{world} rank(s), {kind} tensors", **extra)
            for i, kind in enumerate(kinds)]


def check_ring_shift(ring_shift):
    for world in (1, 2, 3, 5):
        cases = _cases(world, ["float", "int2d"])
        for case, calls in zip(cases, run_p2p_cases(ring_shift, world, cases, exercise="ring_shift"),
                               strict=True):
            what = f"ring_shift on {case['label']}"
            expect_from(calls, case["inputs"], lambda r, n=world: (r - 1) % n, what)
            expect_unchanged(calls, case["inputs"], what)
            expect_new_tensor(calls, what)
            for c in calls:
                nbytes = case["inputs"][c.rank].numel() * case["inputs"][c.rank].element_size()
                sends = [(o.peer, o.nbytes) for o in c.sends]
                expected = [((c.rank + 1) % world, nbytes)] if world > 1 else []
                if sends != expected:
                    raise AssertionError(
                        f"rank {c.rank}: {what} sent {_sends(sends)}; expected exactly one message of "
                        f"{nbytes} bytes to its right neighbour" if world > 1 else
                        f"{what} sent {_sends(sends)}: with a single rank there is nobody to send to "
                        f"(return a copy of x)")


def _sends(sends):
    if not sends:
        return "nothing"
    return ", ".join(f"{nbytes} bytes to rank {peer}" for peer, nbytes in sends)


def check_naive_all_reduce(naive_all_reduce):
    for world, kinds in ((1, ["float"]), (2, ["float", "random64"]), (3, ["random32", "int2d"]),
                         (5, ["random64", "one"])):
        cases = _cases(world, kinds, seed=world)
        for case, calls in zip(cases, run_p2p_cases(naive_all_reduce, world, cases,
                                                exercise="naive_all_reduce"), strict=True):
            what = f"x after naive_all_reduce on {case['label']}"
            expected = torch.stack([x.double() for x in case["inputs"]]).sum(0)
            for c in calls:
                expect_equal(c.after.double(), expected, what, rank=c.rank, atol=1e-5, rtol=1e-5)
            expect_same_bits(calls, what)


def check_p2p_broadcast(p2p_broadcast):
    for world, sources in ((1, [0]), (2, [1, 0]), (3, [2]), (5, [0, 3]), (6, [5]), (8, [1])):
        cases = [dict(inputs=_inputs(world, "float", 0), args=(src,),
                      label=f"{world} rank(s), src={src}") for src in sources]
        for case, calls in zip(cases, run_p2p_cases(p2p_broadcast, world, cases, exercise="p2p_broadcast"),
                               strict=True):
            src = case["args"][0]
            what = f"x after p2p_broadcast on {case['label']}"
            expect_from(calls, case["inputs"], lambda r, s=src: s, what, attr="after")
            expect_tree_messages(calls, world, src, what)


def check_p2p_all_gather(p2p_all_gather):
    for world, kinds in ((1, ["float"]), (2, ["int2d"]), (3, ["random64"]), (5, ["float", "int2d"])):
        cases = _cases(world, kinds, seed=world)
        for case, calls in zip(cases, run_p2p_cases(p2p_all_gather, world, cases, exercise="p2p_all_gather"),
                               strict=True):
            expect_gathered(calls, case["inputs"], f"p2p_all_gather on {case['label']}")
