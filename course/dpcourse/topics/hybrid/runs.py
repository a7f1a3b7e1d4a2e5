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

While grading, every collective goes through the grader's router, whose log
(`observed_traffic`) must be the calls the ranks recorded, in order; the bytes and groups the
checks use are then the router's.
"""

import json
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from dpcourse.comm.cases import WAITED
from dpcourse.comm.recorder import CommOp, CommRecorder
from dpcourse.grading.routed import BACKEND as ROUTED
from dpcourse.runtime.inside_rank import to_cpu
from dpcourse.runtime.launcher import launch, observed_traffic
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


def _grid_side(fn, cases, exercise):
    reports = []
    for index, case in enumerate(cases):
        watch = GroupWatch(prefix=f"dpcourse-grid/{index}")
        try:
            with watch:
                grid = fn(case["dp"], case["tp"], pp=case.get("pp", 1))
            report = _grid_report(grid)
        except GroupOrderError as exc:
            report = {"error": f"GroupOrderError: {exc}"}
        except Exception as exc:  # noqa: BLE001 - reported: bad sizes must raise a ValueError
            report = {"error": f"{type(exc).__name__}: {exc}"[:600]}
        report["created"] = watch.created
        reports.append(report)
        if report.get("error", "").startswith("GroupOrderError"):
            break  # the other ranks are out of step: later cases would only add confusion
    return reports


def run_grid_cases(fn, world_size, cases, *, exercise="make_grid_groups",
                   group_timeout=TIMEOUTS["test_group"]):
    """Launch world_size ranks; in each case every rank calls fn(dp, tp, pp=pp). Returns
    reports[case][rank]: {"sizes", "coords", "members": {axis: world ranks}, "created": [members of
    each group it created, in order], "error": "Type: message" when fn raised}."""
    per_rank = launch(_grid_side, world_size, fn, cases, exercise, group_timeout=group_timeout)
    return [[per_rank[rank][i] if i < len(per_rank[rank]) else {"error": "did not run this case"}
             for rank in range(world_size)] for i in range(len(cases))]


# --------------------------------------------------------------------------- training on a grid

@dataclass
class HybridRun:
    """What one rank did in one case of a hybrid training run (built by the caller)."""

    rank: int
    losses: list = field(default_factory=list)  # what the step returned, step by step (as a float)
    loss_types: list = field(default_factory=list)  # its type, in words (runs._type_of)
    params: list = field(default_factory=list)  # {name: tensor} after each step (local slices)
    steps: list = field(default_factory=list)  # CommOp lists, one per step
    error: str | None = None  # the step raised (a wait that timed out included)
    failed_step: int | None = None  # in which step


def _plain(ops):
    return [[o.op, o.peer, o.nbytes, o.start, o.end, list(o.group) if o.group else None] for o in ops]


def _ops(rows):
    return [CommOp(op, peer, nbytes, start, end, tuple(group) if group else None)
            for op, peer, nbytes, start, end, group in rows or ()]


def _type_of(value):
    """What a step returned, in words: "float", "None", or "torch.Tensor (requires_grad=True)"."""
    if value is None or isinstance(value, float):
        return type(value).__name__
    if isinstance(value, torch.Tensor):
        return f"torch.Tensor (requires_grad={value.requires_grad})"
    return f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")


def _train(case, exercise, build, call):
    """Inside a rank: build the case's objects, then run the learner's step once per batch."""
    rank = dist.get_rank()
    with CommRecorder(exercise=exercise) as setup:
        objects = build(case)
    report = {"setup": _plain(setup.ops), "losses": [], "loss_types": [], "params": [], "steps": []}
    for step, (x, y) in enumerate(case["batches"]):
        recorder = CommRecorder(exercise=exercise)
        try:
            with recorder:
                loss = call(objects, x.clone(), y.clone(), case)
        except Exception as exc:  # noqa: BLE001 - reported with where it happened
            waited = isinstance(exc, RuntimeError) and WAITED.search(str(exc))
            report.update(error=f"{type(exc).__name__}: {exc}"[:800], failed_step=step, waited=bool(waited))
            report["steps"].append(_plain(recorder.ops))
            break
        report["losses"].append(float(loss) if isinstance(loss, (int, float, torch.Tensor)) and
                                (not isinstance(loss, torch.Tensor) or loss.numel() == 1) else
                                (None if loss is None else repr(loss)[:120]))
        report["loss_types"].append(_type_of(loss))
        report["steps"].append(_plain(recorder.ops))
        report["params"].append({n: p.detach().clone() for n, p in objects["model"].named_parameters()})
    report["rank"] = rank
    return to_cpu(report)


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


def _side(kind, step, cases, exercise, pipeline_step=None, timeout=None, make_block=None):
    reports = []
    for case in cases:
        case = dict(case, timeout=timeout, make_block=make_block)
        if kind == "dp_tp":
            reports.append(_train(case, exercise, _dp_tp_build, _dp_tp_call(step)))
        else:
            reports.append(_train(case, exercise, _dp_pp_build, _dp_pp_call(step, pipeline_step)))
        if reports[-1].get("error"):
            break
    return reports


def _runs(per_rank, cases, exercise):
    world = len(per_rank)
    runs = []
    for index in range(len(cases)):
        case_runs = []
        for rank in range(world):
            report = per_rank[rank][index] if index < len(per_rank[rank]) else {
                "error": "stopped before this case: an earlier case failed", "failed_step": 0}
            run = HybridRun(rank, losses=list(report.get("losses") or ()),
                            loss_types=list(report.get("loss_types") or ()),
                            params=list(report.get("params") or ()),
                            steps=[_ops(s) for s in report.get("steps") or ()], error=report.get("error"),
                            failed_step=report.get("failed_step"))
            run.setup = _ops(report.get("setup"))
            run.waited = bool(report.get("waited"))
            case_runs.append(run)
        runs.append(case_runs)
    _take_router_log(runs, exercise)
    return runs


def _take_router_log(runs, exercise):
    """While grading: each rank's recorded calls, in order, must be the router's; then the CommOps
    (bytes, groups, peers) become the router's own. A rank whose step raised may have recorded a
    last call the router refused before seeing it (a message to itself, say)."""
    traffic = observed_traffic()
    if traffic is None:
        return
    for rank, seen in enumerate(traffic):
        recorded = [(case_runs[rank], where, i) for case_runs in runs
                    for where, ops in [("setup", case_runs[rank].setup)] +
                    [(s, ops) for s, ops in enumerate(case_runs[rank].steps)] for i in range(len(ops))]
        recorded = [r for r in recorded if _op_at(*r).op != "barrier"]
        names = [_op_at(*r).op for r in recorded]
        routed = [o for o in seen if o.op != "barrier"]
        failed = any(case_runs[rank].error for case_runs in runs)
        agree = names == [o.op for o in routed] or (
            failed and names[:len(routed)] == [o.op for o in routed] and len(names) - len(routed) <= 1)
        if not agree:
            raise AssertionError(
                f"{exercise}: rank {rank} issued {len(routed)} call(s) as the grader's router saw them "
                f"({', '.join(o.op for o in routed[:8]) or 'none'}), but recorded {len(names)} "
                f"({', '.join(names[:8]) or 'none'}): every collective and message must go through "
                f"torch.distributed where the recorder sees it")
        for (run, where, i), op in zip(recorded, routed, strict=False):
            _set_op(run, where, i, op)


def _op_at(run, where, i):
    return run.setup[i] if where == "setup" else run.steps[where][i]


def _set_op(run, where, i, op):
    (run.setup if where == "setup" else run.steps[where])[i] = op


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
    the same on every rank). Returns runs[case][rank] (HybridRun). make_block(mlp, grid): build each
    block's tensor-parallel MLP another way (a learner's own from notebook 08)."""
    per_rank = launch(_side, world_size, "dp_tp", step, cases, exercise, timeout=group_timeout,
                      make_block=make_block, group_timeout=group_timeout, deadline=deadline)
    return _runs(per_rank, cases, exercise)


def run_dp_pp_cases(step, cases, *, exercise="hybrid_dp_pp_step", pipeline_step=gpipe, world_size=4,
                    group_timeout=TIMEOUTS["p2p_deadlock"], deadline=None):
    """Launch the ranks once; each case builds a (dp, pp) grid with init_device_mesh and the whole
    `dp_pp_model(**case["model"])` on every rank, then calls step(model, cuts, grid, x, y, loss_fn,
    n_micro, lr, pipeline_step) for each (x, y) of case["batches"]. Returns runs[case][rank]."""
    per_rank = launch(_side, world_size, "dp_pp", step, cases, exercise, pipeline_step, timeout=group_timeout,
                      group_timeout=group_timeout, deadline=deadline)
    return _runs(per_rank, cases, exercise)


# --------------------------------------------------------------------------- the planner

def _plan_side(plan, cases):
    outcomes = []
    for model, cluster in cases:
        try:
            result = plan(dict(model), dict(cluster))
            outcomes.append({"result": result if isinstance(result, dict) else repr(result)[:200]})
        except Exception as exc:  # noqa: BLE001 - reported: nothing fitting must raise a ValueError
            outcomes.append({"error": type(exc).__name__, "message": str(exc)[:600]})
    return outcomes


def run_plan_cases(plan, cases):
    """Call plan(model, cluster) for each (model, cluster) in one rank (one launch for all cases);
    [{"result": what it returned} or {"error": exception type, "message": ...}, ...]."""
    return launch(_plan_side, 1, plan, list(cases))[0]
