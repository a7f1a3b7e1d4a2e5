"""Hidden checks of 04_ring_allreduce. Each raises a short AssertionError saying what is wrong.

Every learner function runs under the recorder with p2p_only=True and a 3 s group timeout.
Expected values come from `dist.all_reduce` run on the same ranks (outside the recorder)
or, for the all-gather, from the data the ranks were handed: never from a solution.
Integer-valued inputs are compared exactly, random float64 inputs with a tolerance (a ring
adds in a different order than gloo).
"""

import torch

from dpcourse.comm.p2p import run_p2p_cases
from dpcourse.comm.traffic import expect_ring_traffic
from dpcourse.reference.splits import chunk_bounds
from dpcourse.topics.collectives.checks import (
    expect_all_gathered,
    expect_all_reduced,
    expect_reduce_scattered,
)

# What each exercise's expected values come from (autograder/exercises.json lists them).
REFERENCES = {
    "ring_reduce_scatter": "dist.all_reduce on the same ranks, outside the recorder: chunk r of its sum; "
                           "a ring's messages and bytes (dpcourse.comm.traffic.ring_budget)",
    "ring_all_gather": "the full tensor whose chunk r rank r was handed; a ring's messages and bytes",
    "ring_all_reduce": "dist.all_reduce on the same ranks, outside the recorder; a ring's messages and bytes",
}

GROUPS = ([[0, 2], [1, 3]], [[1, 2, 3]])  # sub-groups tried on 4 ranks


def lengths(world):
    return sorted({1, max(world - 1, 1), 7, 13, 100})


def _values(kind, shape, g):
    if kind == "ints":
        return torch.randint(-50, 50, shape, generator=g).float()
    if kind == "random64":
        return torch.randn(shape, generator=g, dtype=torch.float64)
    if kind == "half":
        return torch.randint(-8, 8, shape, generator=g).to(torch.float16)
    raise ValueError(kind)


def _tolerance(kind):
    return (1e-9, 1e-9) if kind == "random64" else (0.0, 0.0)


def _sum_cases(world, seed):
    """Cases for functions checked against dist.all_reduce: every length, three dtypes, a 2-D tensor."""
    g = torch.Generator().manual_seed(seed)
    cases = []
    for length in lengths(world):
        for kind in ("ints", "random64") if length in (7, 100) else ("ints",):
            cases.append(dict(inputs=[_values(kind, (length,), g) for _ in range(world)], kind=kind,
                              reference="all_reduce", label=f"{world} rank(s), {length} {kind} elements"))
    cases.append(dict(inputs=[_values("half", (13,), g) for _ in range(world)], kind="half",
                      reference="all_reduce", label=f"{world} rank(s), 13 float16 elements"))
    cases.append(dict(inputs=[_values("ints", (3, 5), g) for _ in range(world)], kind="ints",
                      reference="all_reduce", label=f"{world} rank(s), a 3x5 tensor"))
    if world == 4:
        for groups in GROUPS:
            cases.append(dict(inputs=[_values("ints", (11,), g) for _ in range(world)], kind="ints",
                              reference="all_reduce", groups=groups,
                              label=f"4 ranks, 11 elements, group=new_group of ranks {groups}"))
    return cases


def _by_group(calls, case):
    """The calls of each group of a case (the whole world when it has no groups)."""
    if case.get("groups") is None:
        return [calls]
    return [[calls[r] for r in members] for members in case["groups"]]


def _numel_and_size(case):
    x = case["inputs"][0]
    return x.numel(), x.element_size()


def check_ring_reduce_scatter(ring_reduce_scatter):
    for world in (1, 2, 3, 4):
        cases = _sum_cases(world, seed=10 + world)
        for case, calls in zip(cases, run_p2p_cases(ring_reduce_scatter, world, cases,
                                                exercise="ring_reduce_scatter"), strict=True):
            what = f"ring_reduce_scatter on {case['label']}"
            atol, rtol = _tolerance(case["kind"])
            expect_reduce_scattered(calls, case["inputs"], what, atol=atol, rtol=rtol)
            expect_ring_traffic(calls, *_numel_and_size(case), phases=1, what="reduce-scatter")


def gather_cases(world, seed):
    """Rank r holds chunk r of a `full` tensor and garbage (NaN) elsewhere; returns cases with `full`s."""
    g = torch.Generator().manual_seed(seed)
    cases = []
    shapes = [(n,) for n in lengths(world)] + [(3, 5)]
    for shape in shapes:
        for kind in ("ints", "random64", "half") if shape == (13,) else ("ints",):
            cases.append(_gather_case(world, shape, kind, g, None))
    if world == 4:
        for groups in GROUPS:
            cases.append(_gather_case(world, (11,), "ints", g, groups))
    return cases


def _gather_case(world, shape, kind, g, groups):
    inputs = [torch.zeros(shape, dtype=_values(kind, (1,), g).dtype) for _ in range(world)]
    fulls = []
    for members in groups or [list(range(world))]:
        full = _values(kind, shape, g)
        fulls.append(full)
        for index, rank in enumerate(members):
            mine = torch.full(shape, float("nan"), dtype=full.dtype).reshape(-1)
            a, b = chunk_bounds(full.numel(), len(members))[index]
            mine[a:b] = full.reshape(-1)[a:b]
            inputs[rank] = mine.reshape(shape)
    label = f"{world} rank(s), shape {tuple(shape)}, {kind}" + (f", group=new_group of ranks {groups}"
                                                                 if groups else "")
    return dict(inputs=inputs, fulls=fulls, groups=groups, label=label)


def check_ring_all_gather(ring_all_gather):
    for world in (1, 2, 3, 4):
        cases = gather_cases(world, seed=20 + world)
        runnable = [{k: v for k, v in case.items() if k != "fulls"} for case in cases]
        for case, calls in zip(cases, run_p2p_cases(ring_all_gather, world, runnable,
                                                exercise="ring_all_gather"), strict=True):
            what = f"ring_all_gather on {case['label']}"
            for group_calls, full in zip(_by_group(calls, case), case["fulls"], strict=True):
                expect_all_gathered(group_calls, case["inputs"], full, what)
            expect_ring_traffic(calls, *_numel_and_size(case), phases=1, what="all-gather")


def check_ring_all_reduce(ring_all_reduce):
    for world in (1, 2, 3, 4):
        cases = _sum_cases(world, seed=30 + world)
        runs = run_p2p_cases(ring_all_reduce, world, cases, exercise="ring_all_reduce")
        for case, calls in zip(cases, runs, strict=True):
            atol, rtol = _tolerance(case["kind"])
            expect_all_reduced(calls, f"ring_all_reduce on {case['label']}", atol=atol, rtol=rtol)


def check_ring_all_reduce_bandwidth(ring_all_reduce):
    g = torch.Generator().manual_seed(40)
    for world in (2, 3, 4):
        cases = [dict(inputs=[_values("ints", (length,), g) for _ in range(world)], reference="all_reduce",
                      label=f"{world} ranks, {length} float32 elements") for length in (3, 7, 13, 1000)]
        runs = run_p2p_cases(ring_all_reduce, world, cases, exercise="ring_all_reduce")
        for case, calls in zip(cases, runs, strict=True):
            expect_all_reduced(calls, f"ring_all_reduce on {case['label']}")
            expect_ring_traffic(calls, *_numel_and_size(case), phases=2, what="all-reduce")
