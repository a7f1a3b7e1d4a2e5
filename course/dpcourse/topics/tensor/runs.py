"""Run a learner's tensor-parallel operator or module on ranks under the recorder; records back.

    runs = run_operator_cases(copy_to_tp, 4, cases, exercise="copy_to_tp")
    runs[case][rank].output, .input_grad, .forward, .backward      # tensors, and CommOp lists

    runs = run_module_cases(ColumnParallelLinear, 2, cases, exercise="ColumnParallelLinear")
    runs[case][rank].params["weight"], .grads["weight"], .output, .input_grad, .forward, .backward

Why a module: a tensor-parallel piece is graded on what each rank computes forward and
backward *and* on the collectives each direction issues (f: none forward, one all-reduce
backward), on which group. These are its per-case functions on the course's one case runner
(dpcourse.comm.cases; the operators f, g and gather run on dpcourse.comm.operators, which
notebook 12 shares): each rank is sent its own part of a case (its slice of x and of dy where
they are parallel), builds the learner's object itself (test cells never touch it:
docs/authoring.md rule 1), runs forward in one phase and backward in another, and returns plain
values. Expected values are computed in the test cell from the unsharded float64 module
(`checks`), never here; while graded the calls of each phase are the grader's router's.

A case is a dict:
  operator cases: inputs / grads (one tensor per world rank: its x and the gradient of its
      output), groups (None: the whole world, passed as group=None; else lists of world ranks,
      each rank passing its own group), label;
  module cases: full (a builder name in BUILDERS and its keyword arguments), options (keyword
      arguments of the learner's constructor), x (the full input), input ("replicated": every
      rank is sent x; "parallel": rank r is sent its slice of x's last dimension), output
      ("replicated" or "parallel": whether each rank's output gradient is the full dy or its
      slice), dy (the full output gradient), groups, label; or, for a layout the constructor must
      refuse, full, options, groups, label and refuse=True (each rank reports what it raised).
"""

import torch

from dpcourse.backend import rank_device
from dpcourse.comm.cases import Case, members_of, run_cases
from dpcourse.comm.operators import backward_of, parameters_of, run_operator_cases, tensor_or_none, views_of
from dpcourse.reference.shards import row_shard
from dpcourse.runtime.timeouts import TIMEOUTS
from dpcourse.topics.tensor import models

__all__ = ["BUILDERS", "run_operator_cases", "run_module_cases", "run_training"]

BUILDERS = {"linear": models.linear, "mlp": models.mlp, "attention": models.self_attention}
DEFAULTS = {"output": None, "input_grad": None, "input_after": None, "params": {}, "grads": {},
            "no_grad": False, "losses": [], "steps": [], "grad_after": None, "views": {}, "params_before": {},
            "refused": None}


def _refusal(cls, full, group, options):
    """What the constructor raised ("ValueError: 10 output features ..."), or None if it built a module."""
    try:
        cls(full, group, **options)
    except Exception as exc:  # noqa: BLE001 - the check says which exception was expected
        return f"{type(exc).__name__}: {exc}"
    return None


def module_case(cls, part, ctx):
    """Rank side: cls(full, group, **options), forward on this rank's x, backward with its dy."""
    name, kwargs = ctx.shared["full"]
    full = BUILDERS[name](**kwargs)
    options = ctx.shared.get("options", {})
    if ctx.shared.get("refuse"):  # a layout the constructor must refuse (N does not divide the features)
        return {"refused": _refusal(cls, full, ctx.group, options)}
    x, dy = (t.to(rank_device()).clone() for t in part)
    x.requires_grad_()
    ctx.phase("build")
    module = ctx.call(cls, full, ctx.group, **options)
    views = views_of(module, full)
    ctx.phase("forward")
    output = ctx.call(module, x)
    report = {"output": tensor_or_none(output), "views": views}
    backward_of(report, output, dy, ctx)
    report["input_grad"] = tensor_or_none(x.grad)
    return {**report, **parameters_of(module)}


def module_case_of(case, world_size):
    """A module case as the case runner's Case: rank r is sent x (or its slice of x's last dimension,
    input "parallel") and dy (or its slice, output "parallel"); every rank builds the unsharded module
    from its builder's arguments (the constructor's input, the same on every rank)."""
    shared = {"full": case["full"], "options": case.get("options", {}), "refuse": bool(case.get("refuse"))}
    parts = []
    for rank in range(world_size):
        if case.get("refuse"):
            parts.append(())
            continue
        group = members_of(case.get("groups"), rank, world_size)
        index, n = group.index(rank), len(group)
        x = row_shard(case["x"], index, n) if case.get("input") == "parallel" else case["x"]
        dy = row_shard(case["dy"], index, n) if case.get("output") == "parallel" else case["dy"]
        parts.append((x, dy))
    return Case(parts=parts, shared=shared, groups=case.get("groups"), label=case.get("label"), about=case)


def run_module_cases(cls, world_size, cases, *, exercise, group_timeout=TIMEOUTS["test_group"],
                     deadline=None):
    """Launch world_size ranks; each case builds cls(full, group, **options), runs forward and backward."""
    return run_cases(module_case, cls, world_size, [module_case_of(c, world_size) for c in cases],
                     exercise=exercise, group_timeout=group_timeout, deadline=deadline, defaults=DEFAULTS)


def training_case(cls, batches, ctx):
    """Rank side: cls(full, group) trained with plain SGD on the (replicated) batches, a phase per step
    and direction ("forward 0", "backward 0", ...)."""
    name, kwargs = ctx.shared["full"]
    full = BUILDERS[name](**kwargs)
    ctx.phase("build")
    module = ctx.call(cls, full, ctx.group, **ctx.shared.get("options", {}))
    views = views_of(module, full)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    losses, first_output = [], None
    for step, (x, target) in enumerate(batches):
        # x requires grad, like the output of the layer below would: backward then runs f's all-reduce
        x, target = x.to(rank_device()).requires_grad_(), target.to(rank_device())
        ctx.phase(f"forward {step}")
        output = ctx.call(module, x)
        if step == 0:  # the first step's output: a forward that is wrong from the start is explained by it
            first_output = tensor_or_none(output)
        loss = ((output - target) ** 2).mean()
        ctx.phase(f"backward {step}")
        ctx.call(loss.backward)
        with torch.no_grad():
            for p in module.parameters():
                if p.grad is not None:
                    p -= ctx.shared["lr"] * p.grad
                    p.grad = None
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in module.named_parameters()}
    return {"losses": losses, "params": params, "params_before": before, "views": views,
            "output": first_output}


def run_training(cls, world_size, case, *, exercise, group_timeout=TIMEOUTS["test_group"], deadline=None):
    """Launch world_size ranks that train cls(full, group) with plain SGD for len(case["batches"]) steps.

    case: full, groups, label, lr, batches (a list of (x, target) pairs, one per step; x replicated
    on every rank, requiring grad). The loss, mean squared error against the target, is the same
    on every rank of a group. Returns one RankRun per world rank: params after training, the
    loss of every step, and (forward, backward) CommOp lists of every step (`steps`).
    """
    runnable = Case(parts=[list(case["batches"])] * world_size,
                    shared={"full": case["full"], "options": case.get("options", {}), "lr": case["lr"]},
                    groups=case.get("groups"), label=case.get("label"), about=case)
    runs = run_cases(training_case, cls, world_size, [runnable], exercise=exercise,
                     group_timeout=group_timeout, deadline=deadline, defaults=DEFAULTS)
    for run in runs.unchecked[0]:
        steps = len(run.values.get("losses") or ())
        run.values["steps"] = [(run.phases.get(f"forward {i}", []), run.phases.get(f"backward {i}", []))
                               for i in range(steps)]
    return runs[0]
