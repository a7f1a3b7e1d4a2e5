"""Run a point-to-point exercise on one tensor per rank, and judge values, messages and bytes.

    runs = run_p2p(ring_shift, [torch.full((3,), float(r)) for r in range(4)], exercise="ring_shift")
    runs[2].result, runs[2].after, runs[2].ops     # what rank 2 returned, its input after, its calls
    expect_ring_traffic(runs, numel=3, element_size=4, phases=2, what="ring_all_reduce")

Why a module (the per-case function of notebooks 03 and 04, on the case runner dpcourse.comm.cases):
their exercises are graded on three things -- the values each rank ends with, that only
point-to-point calls were used (a collective would do the work for you), and how many messages and
bytes each rank sent (a ring is *defined* by them). Each rank is sent its own input only, runs the
learner's function under the recorder with p2p_only (which forbids `dist.all_reduce` and the
process-group bypass, and counts every send and recv), and a deadlock ends in seconds with a sentence
naming the ranks and the call each was stuck in. While graded, the values are replayed against the
messages (comm.provenance.Sums): a rank that knows the test's inputs, computes the answer alone and
sends zeros in the right pattern loses the cell.
"""

import torch

from dpcourse.backend import rank_device
from dpcourse.comm.cases import Case, members, run_cases, shares_memory
from dpcourse.comm.provenance import Sums
from dpcourse.runtime.timeouts import TIMEOUTS

GROUP_TIMEOUT = TIMEOUTS["p2p_deadlock"]  # seconds a blocked send/recv waits: then it is a deadlock


def call_on_own_tensor(fn, x, ctx):
    """Rank side: fn(x, *args, **kwargs[, group=]) on this rank's own input, moved to its device and
    cloned (so `after` shows what an in-place function did to it)."""
    x = x.to(rank_device()).clone() if isinstance(x, torch.Tensor) else x
    result = fn(x, *ctx.shared["args"], **ctx.shared["kwargs"], **ctx.group_kwargs)
    return {"result": result, "after": x, "aliases_input": shares_memory(result, x)}


def p2p_case(case):
    """A case of run_p2p_cases (a dict: inputs, one per world rank; args, kwargs, reference, groups,
    label) as the case runner's Case: rank r is sent inputs[r] and the arguments."""
    inputs = list(case["inputs"])
    shared = {"args": tuple(case.get("args", ())), "kwargs": dict(case.get("kwargs") or {})}
    return Case(parts=inputs, shared=shared, groups=case.get("groups"), label=case.get("label"),
                replay=Sums(inputs), about=case)


def run_p2p(fn, inputs, *, exercise, args=(), kwargs=None, reference=None, groups=None,
            group_timeout=GROUP_TIMEOUT, deadline=None, label=None):
    """Launch len(inputs) ranks; rank r calls fn(inputs[r], *args, **kwargs) with p2p only.

    reference="all_reduce" also gives each run the expected value: what `dist.all_reduce` leaves (the
    inputs of the group's ranks added up, worked out here). groups: lists of world ranks; each rank
    calls fn with `group=` the group it belongs to. Returns one RankRun per world rank; raises an
    AssertionError naming ranks and calls on a deadlock or a collective.
    """
    case = dict(inputs=list(inputs), args=tuple(args), kwargs=dict(kwargs or {}), reference=reference,
                groups=groups, label=label)
    return run_p2p_cases(fn, len(inputs), [case], exercise=exercise, group_timeout=group_timeout,
                         deadline=deadline)[0]


def run_p2p_cases(fn, world_size, cases, *, exercise, group_timeout=GROUP_TIMEOUT, deadline=None):
    """Several run_p2p cases (dicts of its arguments) on the same ranks, in one launch; runs[case][rank]."""
    runs = run_cases(call_on_own_tensor, fn, world_size, [p2p_case(c) for c in cases], exercise=exercise,
                     p2p_only=True, group_timeout=group_timeout, deadline=deadline)
    for case, case_runs in zip(cases, runs.unchecked, strict=True):
        if case.get("reference") == "all_reduce":
            for run in members(case_runs):
                run.values["expected"] = _sum_over(case["inputs"], run.group)
    return runs


def _sum_over(inputs, group):
    """What dist.all_reduce (SUM) leaves on every member: the inputs added in member order."""
    total = inputs[group[0]].detach().cpu().clone()
    for m in group[1:]:
        total = total + inputs[m].detach().cpu()
    return total
