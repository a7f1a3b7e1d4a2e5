"""Run a learner's grid, hybrid step or pipeline on ranks; plain reports back, verdicts elsewhere.

    reports = run_grid_cases(make_grid_groups, 4, [dict(dp=2, tp=2, label="2 x 2")])
    reports[case][rank]["coords"], ["members"], ["created"], ["error"]

    runs = run_dp_tp_cases(hybrid_dp_tp_step, [case], exercise="hybrid_dp_tp_step")
    runs[case][rank].losses, .params[step], .steps[step]           # floats, tensors, CommOps

Why a module: the exercises of notebook 09 are judged on what each rank computed (its
coordinates and groups, its losses and parameters step after step) and on every collective
and message it issued, with the group it ran on. Each rank runs the learner's code on objects
built inside the rank (a Grid and a model from torch's init_device_mesh, so no exercise depends
on another), under the recorder of notebook 03, and returns plain values; expected values and
verdicts are computed by the caller (`checks`), never here (docs/authoring.md, rules 1-4).

Creating groups in a different order on different ranks hangs gloo: `new_group` is collective
and names groups by how many were created before, so two ranks can disagree about which
members "group 3" has and wait for each other forever. While `make_grid_groups` runs, each
rank records the members of every group it creates (`GroupWatch`, which wraps dist.new_group);
under gloo or NCCL it also compares, through the launch's store, its k-th group with every
other rank's k-th before creating it, and raises `GroupOrderError` instead of hanging. The
records go back to the caller, which judges the order itself (under the grader, groups need no
rendezvous, so nothing hangs and the records are all there is to judge).

These are its per-case functions on the course's one case runner (dpcourse.comm.cases): every
rank is sent the case as the exercise hands it to every rank (the grid's sizes, the model's
arguments, the global batch: a replica takes its rows itself), and while grading the calls of each
step are the grader's router's (bytes, groups), cut where the rank's recorder says each step began.
"""

import json
from datetime import timedelta

import torch
import torch.distributed as dist

from dpcourse.comm.cases import WAITED, Case, run_cases
from dpcourse.comm.provenance import Copies
from dpcourse.grading.routed import BACKEND as ROUTED
from dpcourse.runtime.timeouts import TIMEOUTS
from dpcourse.topics.hybrid.grid import AXES, mesh_grid
from dpcourse.topics.hybrid.models import dp_pp_model, dp_tp_model, tensor_parallel_copy
from dpcourse.topics.hybrid.pipeline import gpipe
from dpcourse.toys.models import loss_fn as mse_loss

ORDER_RULE = "every rank must create every group in the same order, or it hangs"


class GroupOrderError(RuntimeError):
    """This rank was about to create a group that another rank created at a different place."""


# --------------------------------------------------------------------------- group creation

class GroupWatch:
    """Inside a rank: record every dist.new_group call (members, in order) while in the block.

    Under a real backend, also agree on each group with every other rank through the store
    before creating it (see the module docstring); `prefix` keeps cases of one launch apart.
    """

    def __init__(self, prefix, timeout=TIMEOUTS["p2p_deadlock"]):
        self.prefix, self.timeout, self.created = prefix, timeout, []
        self._patched = []

    def __enter__(self):
        import torch.distributed.device_mesh as device_mesh
        import torch.distributed.distributed_c10d as c10d

        real = c10d.new_group

        def new_group(ranks=None, *args, **kwargs):
            world = dist.get_world_size()
            members = sorted(int(r) for r in ranks) if ranks is not None else list(range(world))
            self._agree(len(self.created), members)
            self.created.append(members)
            return real(ranks, *args, **kwargs)

        for module in (dist, c10d, device_mesh):
            if hasattr(module, "new_group"):
                self._patched.append((module, module.new_group))
                module.new_group = new_group
        return self

    def __exit__(self, *exc):
        for module, original in reversed(self._patched):
            module.new_group = original
        self._patched = []
        return False

    def _agree(self, k, members):
        if dist.get_backend().lower() == ROUTED.lower():
            return  # the grader's groups need no rendezvous: the caller judges the records
        store = dist.distributed_c10d._get_default_store()
        rank, world = dist.get_rank(), dist.get_world_size()
        store.set(f"{self.prefix}/{k}/{rank}", json.dumps(members))
        for other in range(world):
            if other == rank:
                continue
            key = f"{self.prefix}/{k}/{other}"
            try:
                store.wait([key], timedelta(seconds=self.timeout))
            except Exception as exc:  # noqa: BLE001 - a store timeout: the other rank never got here
                raise GroupOrderError(
                    f"rank {rank} created group number {k + 1} (members {members}), but rank {other} "
                    f"did not create a group number {k + 1} within {self.timeout:g} s: {ORDER_RULE} "
                    f"(dist.new_group is collective: every rank of the world calls it for every "
                    f"group, also for the groups it is not a member of)") from exc
            theirs = json.loads(store.get(key))
            if theirs != members:
                raise GroupOrderError(
                    f"rank {rank}'s group number {k + 1} has members {members}, rank {other}'s has "
                    f"{theirs}: {ORDER_RULE} (dist.new_group is collective and numbers the groups in "
                    f"the order they are created)")


def _grid_report(grid):
    """Plain values of a learner's Grid: sizes, coords, and the members of each axis' group."""
    missing = [a for a in ("sizes", "coords", "groups") if not isinstance(getattr(grid, a, None), dict)]
    if missing:
        return {"error": f"returned {type(grid).__name__} {str(grid)[:120]}, expected a Grid with dicts "
                         f"sizes, coords and groups (dpcourse.topics.hybrid.grid.Grid)"}
    report = {"sizes": {a: grid.sizes.get(a) for a in AXES}, "coords": {a: grid.coords.get(a) for a in AXES},
              "members": {}}
    for axis in AXES:
        group = grid.groups.get(axis)
        if group is None:
            report["members"][axis] = "None" if axis in grid.groups else "missing"
            continue
        try:
            report["members"][axis] = [int(r) for r in dist.get_process_group_ranks(group)]
        except Exception as exc:  # noqa: BLE001 - a group that is no group of this rank
            report["members"][axis] = f"not a process group of this rank ({type(exc).__name__}: {exc})"[:200]
    return report


_OUT_OF_STEP = []  # inside a rank: a GroupOrderError happened; later cases would only add confusion


def grid_case(fn, part, ctx):
    """Rank side: fn(dp, tp, pp=pp) under a GroupWatch; what it built, or what it raised (bad sizes must
    raise a ValueError: a report, not a failure)."""
    if _OUT_OF_STEP:
        return {"error": "did not run this case"}
    watch = GroupWatch(prefix=f"dpcourse-grid/{ctx.case.index}")
    try:
        with watch:
            grid = fn(ctx.shared["dp"], ctx.shared["tp"], pp=ctx.shared.get("pp", 1))
        report = _grid_report(grid)
    except GroupOrderError as exc:
        report = {"error": f"GroupOrderError: {exc}"}
        _OUT_OF_STEP.append(True)
        ctx.ended = "the ranks created their groups in different orders"
    except Exception as exc:  # noqa: BLE001 - reported: bad sizes must raise a ValueError
        report = {"error": f"{type(exc).__name__}: {exc}"[:600]}
    report["created"] = watch.created
    return report


def run_grid_cases(fn, world_size, cases, *, exercise="make_grid_groups",
                   group_timeout=TIMEOUTS["test_group"]):
    """Launch world_size ranks; in each case every rank calls fn(dp, tp, pp=pp). Returns
    reports[case][rank]: {"sizes", "coords", "members": {axis: world ranks}, "created": [members of
    each group it created, in order], "error": "Type: message" when fn raised}."""
    runnable = [Case(parts=[()] * world_size, shared=dict(case), label=case.get("label"), about=case)
                for case in cases]
    runs = run_cases(grid_case, fn, world_size, runnable, exercise=exercise, group_timeout=group_timeout)
    return [[dict(run.values) if run.group is not None else {"error": "did not run this case"}
             for run in case_runs] for case_runs in runs.unchecked]


# --------------------------------------------------------------------------- training on a grid

def _type_of(value):
    """What a step returned, in words: "float", "None", or "torch.Tensor (requires_grad=True)"."""
    if value is None or isinstance(value, float):
        return type(value).__name__
    if isinstance(value, torch.Tensor):
        return f"torch.Tensor (requires_grad={value.requires_grad})"
    return f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")


STOPPED = {"error": "stopped before this case: an earlier case failed", "failed_step": 0}
DEFAULTS = {"losses": [], "loss_types": [], "params": [], "steps": [], "setup": [], "error": None,
            "failed_step": None, "waited": False}


def train_case(step, batches, ctx):
    """Rank side: build the case's objects (phase "setup"), then run the learner's step once per (global)
    batch, each in a phase of its own ("step 0", ...). A step that raises is reported (the checks say
    what went wrong), and ends the rank's cases."""
    case = dict(ctx.shared)
    build, call = (_dp_tp_build, _dp_tp_call(step)) if case["kind"] == "dp_tp" else (
        _dp_pp_build, _dp_pp_call(step, case["pipeline_step"]))
    ctx.phase("setup")
    objects = build(case)
    report = {"losses": [], "loss_types": [], "params": []}
    for index, (x, y) in enumerate(batches):
        ctx.phase(f"step {index}")
        try:
            loss = call(objects, x.clone(), y.clone(), case)
        except Exception as exc:  # noqa: BLE001 - reported with where it happened
            waited = isinstance(exc, RuntimeError) and WAITED.search(str(exc))
            report.update(error=f"{type(exc).__name__}: {exc}"[:800], failed_step=index, waited=bool(waited))
            ctx.ended = report["error"]
            break
        report["losses"].append(float(loss) if isinstance(loss, (int, float, torch.Tensor)) and
                                (not isinstance(loss, torch.Tensor) or loss.numel() == 1) else
                                (None if loss is None else repr(loss)[:120]))
        report["loss_types"].append(_type_of(loss))
        report["params"].append({n: p.detach().clone() for n, p in objects["model"].named_parameters()})
    report["rank"] = ctx.rank
    return report


def _dp_tp_build(case):
    dp, tp = case["grid"]
    grid, mesh = mesh_grid(dp, tp=tp, pp=1, timeout=case["timeout"])
    make_block = case.get("make_block")
    model = tensor_parallel_copy(dp_tp_model(**case["model"]), mesh["tp"],
                                 make_block=None if make_block is None else lambda mlp: make_block(mlp, grid))
    return {"grid": grid, "model": model}


def _dp_tp_call(step):
    def call(objects, x, y, case):
        return step(objects["model"], objects["grid"], x, y, mse_loss, case["lr"])
    return call


def _dp_pp_build(case):
    dp, pp = case["grid"]
    grid, _ = mesh_grid(dp, tp=1, pp=pp, timeout=case["timeout"])
    return {"grid": grid, "model": dp_pp_model(**case["model"])}


def _dp_pp_call(step, pipeline_step):
    def call(objects, x, y, case):
        return step(objects["model"], list(case["cuts"]), objects["grid"], x, y, mse_loss, case["n_micro"],
                    case["lr"], pipeline_step)
    return call


def replica_gradients(model, batches, lr, dp):
    """Per data-parallel replica, its gradient (of the mean loss over its rows, batch.tensor_split(dp))
    at every step, flattened end to end, the model trained as hybrid.checks.reference_training trains it
    (SGD on the whole batch's mean loss): what each replica's dp all-reduce must carry."""
    params = list(model.parameters())
    out = [[] for _ in range(dp)]
    for x, y in batches:
        for d, (xd, yd) in enumerate(zip(x.tensor_split(dp), y.tensor_split(dp), strict=True)):
            out[d] += [g.reshape(-1) for g in torch.autograd.grad(mse_loss(model(xd), yd), params)]
        grads = torch.autograd.grad(mse_loss(model(x), y), params)
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p -= lr * g
    return [torch.cat(g).detach() for g in out]


def dp_replay(case, world_size, kind):
    """What a training case's dp all-reduces must carry (provenance.Copies): each rank's replica's
    gradient (or that divided by dp), never made up; the tp collectives and the pipeline's messages are
    not replayed (their values are activations and partial sums)."""
    dp, other = case["grid"]
    model = (dp_tp_model if kind == "dp_tp" else dp_pp_model)(**case["model"])
    grads = replica_gradients(model, case["batches"], case["lr"], dp)
    mesh = torch.arange(world_size).view(dp, other)
    dp_groups = {tuple(mesh[:, j].tolist()) for j in range(other)}
    derived = [[(None, torch.cat([grads[r // other], grads[r // other] / dp]))] for r in range(world_size)]
    return Copies([None] * world_size, derived=derived,
                  only=lambda event: event[0] == "collective" and tuple(event[1]) in dp_groups)


def _train_cases(step, world_size, cases, exercise, group_timeout, deadline, **shared):
    """Every training case on the same ranks; runs[case][rank], with `steps` (the calls of each step,
    the router's while graded) and `setup` among its values."""
    runnable = [Case(parts=[list(case["batches"])] * world_size,
                     shared={**{k: v for k, v in case.items() if k != "batches"}, **shared},
                     label=case.get("label"), about=case, replay=dp_replay(case, world_size, shared["kind"]))
                for case in cases]
    runs = run_cases(train_case, step, world_size, runnable, exercise=exercise, group_timeout=group_timeout,
                     deadline=deadline, defaults=DEFAULTS)
    for case_runs in runs.unchecked:
        for run in case_runs:
            if run.group is None:  # it stopped at an earlier case's error
                run.values.update(STOPPED)
                continue
            run.values["setup"] = run.phases.get("setup", [])
            run.values["steps"] = [run.phases[f"step {i}"] for i in range(len(run.phases))
                                   if f"step {i}" in run.phases]
    return runs


def raise_failure(case_runs):
    """In a demo cell, before drawing a case's runs: the first rank that raised raises again here,
    a NotImplementedError as itself (so `unless_not_written` says which exercise is not written
    yet), anything else as a RuntimeError naming the rank. Takes runs (`.error`) or grid reports
    (dicts with "error")."""
    for rank, run in enumerate(case_runs):
        error = run.get("error") if isinstance(run, dict) else run.error
        if error:
            if error.startswith("NotImplementedError"):
                raise NotImplementedError(error)
            raise RuntimeError(f"rank {getattr(run, 'rank', rank)}: {error}")


def run_dp_tp_cases(step, cases, *, exercise="hybrid_dp_tp_step", world_size=4, make_block=None,
                    group_timeout=TIMEOUTS["test_group"], deadline=None):
    """Launch the ranks once; each case builds a (dp, tp) grid with init_device_mesh and the
    tensor-parallel copy of `dp_tp_model(**case["model"])` on its tp axis, then calls
    step(model, grid, x, y, loss_fn, lr) for each (x, y) of case["batches"] (the global batch,
    the same on every rank). Returns runs[case][rank] (comm.cases.RankRun: losses, loss_types, params,
    steps, setup, error, failed_step, waited). make_block(mlp, grid): build each block's tensor-parallel
    MLP another way (a learner's own from notebook 08)."""
    return _train_cases(step, world_size, cases, exercise, group_timeout, deadline, kind="dp_tp",
                        timeout=group_timeout, make_block=make_block)


def run_dp_pp_cases(step, cases, *, exercise="hybrid_dp_pp_step", pipeline_step=gpipe, world_size=4,
                    group_timeout=TIMEOUTS["p2p_deadlock"], deadline=None):
    """Launch the ranks once; each case builds a (dp, pp) grid with init_device_mesh and the whole
    `dp_pp_model(**case["model"])` on every rank, then calls step(model, cuts, grid, x, y, loss_fn,
    n_micro, lr, pipeline_step) for each (x, y) of case["batches"]. Returns runs[case][rank]."""
    return _train_cases(step, world_size, cases, exercise, group_timeout, deadline, kind="dp_pp",
                        timeout=group_timeout, pipeline_step=pipeline_step)


# --------------------------------------------------------------------------- the planner

def plan_case(plan, part, ctx):
    """Rank side: plan(model, cluster), or what it raised (nothing fitting must raise a ValueError)."""
    model, cluster = part
    try:
        result = plan(dict(model), dict(cluster))
        return {"result": result if isinstance(result, dict) else repr(result)[:200]}
    except Exception as exc:  # noqa: BLE001 - reported: nothing fitting must raise a ValueError
        return {"error": type(exc).__name__, "message": str(exc)[:600]}


def run_plan_cases(plan, cases):
    """Call plan(model, cluster) for each (model, cluster) in one rank (one launch for all cases);
    [{"result": what it returned} or {"error": exception type, "message": ...}, ...]."""
    runs = run_cases(plan_case, plan, 1, [Case(parts=[tuple(c)]) for c in cases], exercise="plan")
    return [dict(case_runs[0].values) for case_runs in runs]
