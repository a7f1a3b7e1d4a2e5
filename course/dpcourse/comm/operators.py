"""Run a learner's collective autograd operator on ranks, forward and backward: the per-case function of
tensor parallelism's f, g and gather (notebook 08) and sequence parallelism's gather and reduce-scatter
(notebook 12), on the case runner (dpcourse.comm.cases).

    runs = run_operator_cases(copy_to_tp, 4, cases, exercise="copy_to_tp")
    runs[case][rank].output, .input_grad, .input_after, .forward, .backward   # tensors, CommOp lists

A case is a dict: inputs / grads (one tensor per world rank: its x and the gradient of its output),
groups (None: the whole world, passed as group=None; else lists of world ranks, each rank passing its
own group), label. Rank r is sent inputs[r] and grads[r] only; it calls op(x, group=...) under the
recorder (phase "forward"), then output.backward(dy) (phase "backward"), and reports plain values.
Expected values are computed by the caller from the inputs (the chapters' `*_semantics`).

Why a module below the topics: two chapters grade the same kind of exercise (a collective one way, its
adjoint the other), the same way. Their values could be computed without the collectives (a rank
that knew every input could return the sum itself), so while graded each case's collectives are
replayed (comm.provenance.Sums over each rank's x and dy end to end): what a rank puts into an
all-reduce, all-gather or reduce-scatter must be made of data it had.
"""

import torch

from dpcourse.backend import rank_device
from dpcourse.comm.cases import Case, run_cases
from dpcourse.comm.provenance import Sums
from dpcourse.runtime.timeouts import TIMEOUTS

DEFAULTS = {"output": None, "input_grad": None, "input_after": None, "no_grad": False, "grad_after": None}


def tensor_or_none(value):
    """A detached copy of a tensor, or None: what a rank reports of something the learner returned."""
    return value.detach().clone() if isinstance(value, torch.Tensor) else None


def parameters_of(module):
    """{"params": the module's parameters, "grads": their gradients (None: none)}, by name, as plain
    copies: what a rank reports of the learner's module after a case (08, 12)."""
    return {"params": {n: p.detach().clone() for n, p in module.named_parameters()},
            "grads": {n: tensor_or_none(p.grad) for n, p in module.named_parameters()}}


def views_of(module, full):
    """{parameter name: (elements of the memory it keeps, its own elements)} for the module's parameters
    that share memory with the unsharded module's (a view, not a copy: it keeps the whole weight alive
    and an update of it writes into the unsharded module)."""
    theirs = {p.untyped_storage().data_ptr() for p in full.parameters()}
    return {name: (p.untyped_storage().nbytes() // p.element_size(), p.numel())
            for name, p in module.named_parameters() if p.untyped_storage().data_ptr() in theirs}


def backward_of(report, output, dy, ctx):
    """output.backward(dy) in phase "backward"; what happened goes into the report (and dy, if the
    backward changed the gradient it was handed in place). Used by the per-case functions of 08 and 12."""
    ctx.phase("backward")
    if not isinstance(output, torch.Tensor):
        raise RuntimeError(f"{ctx.exercise} ({ctx.label}) returned {type(output).__name__} on rank "
                           f"{ctx.rank}, expected a tensor")
    if not output.requires_grad:
        report["no_grad"] = True
        return
    if output.shape != dy.shape:
        return  # the check reports the output's shape; backward would only raise about it
    before = dy.clone()
    ctx.call(output.backward, dy)
    if not torch.equal(dy, before):
        report["grad_after"] = dy.detach().clone()


def operator_case(op, part, ctx):
    """Rank side: op(x, group=...) on this rank's own x, then backward with its own dy."""
    x, dy = (t.to(rank_device()).clone() for t in part)
    x.requires_grad_()
    ctx.phase("forward")
    output = ctx.call(op, x, group=ctx.group)
    report = {"output": tensor_or_none(output), "input_after": tensor_or_none(x)}
    backward_of(report, output, dy, ctx)
    report["input_grad"] = tensor_or_none(x.grad)
    return report


def operator_case_of(case):
    """A dict case as the case runner's Case: rank r is sent (inputs[r], grads[r])."""
    parts = [(x, dy) for x, dy in zip(case["inputs"], case["grads"], strict=True)]
    return Case(parts=parts, groups=case.get("groups"), label=case.get("label"),
                replay=Sums([list(p) for p in parts], finals=()), about=case)


def run_operator_cases(op, world_size, cases, *, exercise, group_timeout=TIMEOUTS["test_group"],
                       deadline=None):
    """Launch world_size ranks once; in each case rank r calls op(inputs[r], group=...) and then
    backward(grads[r]). Returns runs[case][rank] (comm.cases.RankRun)."""
    return run_cases(operator_case, op, world_size, [operator_case_of(c) for c in cases], exercise=exercise,
                     group_timeout=group_timeout, deadline=deadline, defaults=DEFAULTS)
