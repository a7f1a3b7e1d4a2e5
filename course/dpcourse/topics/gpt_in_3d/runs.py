"""Run notebook 13's exercises on ranks: each rank is sent only its own part of a case, returns plain values.

    reports = run_cases("block", {"block_plan": block_plan}, 2, cases, exercise="block_plan")
    reports[case][rank]["output"], ["phases"], ["ops"]      # ops: the router's records while graded

Why one module: every test cell, hidden check, picture and benchmark of notebook 13 runs the learner's
functions the same way, and the grader needs it written like this:
  * a case is a dict with a "kind"; `own_part(case, rank)` cuts from it what rank `rank` may see -- its
    piece of the sequence, its data-parallel rows (the inputs only on a first pipeline stage, the targets
    only on a last one), never its peers' -- and `launch(..., per_rank(parts))` sends each rank only its
    part (while graded a rank cannot read the case from its caller);
  * inside the rank `CASES[kind](learner, part)` builds the model from the case's seed (every rank builds
    the same full model, then keeps its share, as with torch's APIs), runs the learner's functions and
    returns plain values; the caller computes the expected ones (checks.py), never a rank;
  * a failure is reported as a value ({"error": [where, what]} or {"waited": ...}), so the caller names the
    lowest rank that failed whatever the timing;
  * each rank marks the phases of its case ("build", "step 0", ...) at the count of calls it had made;
    while graded the router's own records of the same calls replace the rank's (`_attach_ops`), so bytes
    per group are counted where the learner's code cannot touch them.
Several cases share one launch: a launch of 8 ranks and its DTensor start-up cost seconds here, a case
after the first much less.

Case kinds (the fields each one reads):
  mesh        layout (dp, pp, tp)
  block       config, seed, tp, replicas [(x, dy), ...] one per data-parallel row (whole (batch, seq, d)
              tensors: rank (row, t) gets its piece t of dim 1), rng_seed
  pipeline    config, seed, layout (dp, pp), costs, n_micro, rows (the global batch, (B, seq + 1))
  fsdp        config, seed, dp, rows, lr
  train       config, seed, layouts, recipe, steps [[rows of step k], ...] (global batches), n_micro, dtype
  checkpoint  config, seed, layouts (the first, the second), recipe, steps (global batches, the first
              `split` in the first layout), split, n_micro, dtype, path (a folder every rank can write)
"""

import contextlib
import datetime
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from dpcourse.backend import rank_device
from dpcourse.comm import recorder as comm_recorder
from dpcourse.comm.cases import WAITED
from dpcourse.comm.recorder import CommOp, CommRecorder
from dpcourse.reference.lm import make_optimizer
from dpcourse.runtime.inside_rank import memory_mark, to_cpu
from dpcourse.runtime.launcher import launch, launch_options, observed_memory, observed_traffic, per_rank
from dpcourse.runtime.timeouts import TIMEOUTS
from dpcourse.topics.tensor.realapi import quiet_dtensor
from dpcourse.toys.gpt import GPTConfig, gpt, lm_loss

AXES = ("dp", "pp", "tp")


# --------------------------------------------------------------------------- the caller's side

# seconds a launch may take, by case kind (else the launch's own): 8 ranks with DTensor's start-up take
# seconds a layout on 2 loaded cores
DEADLINES = {"train": 150.0, "checkpoint": 150.0}


def run_cases(kind, learner, world_size, cases, *, exercise, group_timeout=TIMEOUTS["test_group"],
              deadline=None, measure_memory=False, advice=""):
    """Launch world_size ranks once for every case (all of one kind); returns [case][rank] reports, each
    with "phases" ([label, first call index]) and "ops" (CommOp list: the router's while graded).

    learner: {name: the learner's function} -- what CASES[kind] calls. Raises an AssertionError naming the
    lowest rank whose learner code raised (or the ranks that waited in vain) in the first case that failed,
    followed by `advice` (or ADVICE[kind]).
    """
    cases = [dict(case, kind=kind) for case in cases]
    if deadline is None:
        deadline = DEADLINES.get(kind)
    parts = per_rank([[own_part(case, rank) for case in cases] for rank in range(world_size)])
    # a folder the ranks write (a checkpoint's) travels as an argument of its own: while graded, the folders
    # named in a launch's plain arguments are the ones its sandboxed ranks share (dpgrader/judge/ranks.py)
    folders = [case["path"] for case in cases if case.get("path")]
    with launch_options(exercise=exercise, measure_memory=measure_memory):
        per_rank_reports = launch(_rank_side, world_size, learner, parts, exercise, group_timeout, folders,
                                  group_timeout=group_timeout, deadline=deadline)
    memory = observed_memory() if measure_memory else None
    _attach_ops(per_rank_reports, observed_traffic(), exercise)
    raise_first_failure(per_rank_reports, cases, exercise, advice or ADVICE.get(kind, ""))
    reports = [[per_rank_reports[rank][index] for rank in range(world_size)] for index in range(len(cases))]
    if memory is not None:
        for rank, measured in enumerate(memory):
            for case_reports in reports:
                case_reports[rank]["memory"] = measured
    return reports


# What torch's own error means in a case of this kind: (kind, text in the error, the cause in the learner's
# terms)
DIAGNOSES = [
    ("block", "must match the size of tensor",
     " -- the shapes inside the block do not fit together: the plan's layouts must chain (q, k, v and fc1 "
     "ColwiseParallel: whole heads and features per rank; proj and fc2 RowwiseParallel(output_layouts="
     "Shard(1)): their partial sums scattered back along the sequence, as the residual stream is)"),
    ("pipeline", "IndexError",
     " -- a stage's index is this rank's place on the pp dimension (pp_mesh.get_local_rank()), not a "
     "function of its world rank: a (dp, pp, tp) layout has dp x tp pipelines of pp stages each"),
    ("pipeline", "cannot be larger than number of stages",
     " -- a PipelineStage's group is its own pipeline's (group=pp_mesh.get_group()); without one it is "
     "the whole world, every pipeline at once"),
]


def diagnosis(kind, error):
    """The cause DIAGNOSES names for torch's error text in a case of `kind`, or ""."""
    return next((said for k, text, said in DIAGNOSES if k == kind and text in error), "")


ADVICE = {
    "checkpoint": (" -- dcp.save and dcp.load are collectives: every rank calls them, with the state_dicts "
                   "that "
                   "get_state_dict(model, optimizer) returns (keyed by the parameters' canonical names, "
                   "which "
                   "another layout finds again; an optimizer's own state_dict() numbers its parameters in "
                   "this "
                   "stage's order)"),
}


def raise_first_failure(per_rank_reports, cases, exercise, advice=""):
    """The first case that went wrong, as an AssertionError: its lowest rank whose learner code raised,
    else the ranks that waited in vain for a peer."""
    for index, case in enumerate(cases):
        reports = [r[index] if index < len(r) else {} for r in per_rank_reports]
        label = case.get("label") or exercise
        errors = [(rank, r["error"]) for rank, r in enumerate(reports) if r.get("error")]
        if errors:
            rank, (where, what) = errors[0]
            said = diagnosis(case["kind"], what) or advice
            raise AssertionError(f"{where} raised on rank {rank} ({label}){said}: {what}")
        waited = [rank for rank, r in enumerate(reports) if r.get("waited")]
        if waited:
            raise AssertionError(
                f"{exercise} ({label}): rank(s) {waited} waited in vain for their peers "
                f"({reports[waited[0]]['waited']}): "
                f"every rank of a group must make the same calls in the same order{advice}")
        if any(index >= len(r) for r in per_rank_reports):
            missing = [rank for rank, r in enumerate(per_rank_reports) if index >= len(r)]
            raise AssertionError(f"{exercise} ({label}): rank(s) {missing} stopped before this case")


def _attach_ops(per_rank_reports, traffic, exercise):
    """Every report's "ops": its calls as the rank recorded them, or, while graded, the router's records of
    the same calls (the rank's recorded sequence must be the router's, op for op: every call goes through
    torch.distributed where the recorder sees it)."""
    for rank, reports in enumerate(per_rank_reports):
        recorded = [[CommOp.from_row(row) for row in r.get("ops") or ()] for r in reports]
        if traffic is not None:
            routed = list(traffic[rank])
            flat = [o for ops in recorded for o in ops]
            if [o.op for o in routed] != [o.op for o in flat]:
                raise AssertionError(
                    f"{exercise}: rank {rank} made {len(routed)} communication call(s) as the grader's "
                    f"router saw "
                    f"them, but recorded {len(flat)}: every call must go through torch.distributed where the "
                    f"recorder sees it")
            at = 0
            for ops, report in zip(recorded, reports, strict=True):
                report["ops"] = routed[at:at + len(ops)]
                at += len(ops)
        else:
            for ops, report in zip(recorded, reports, strict=True):
                report["ops"] = ops


def phase_seconds(report):
    """{phase: seconds from its mark to the next} of one rank's case."""
    marks = report.get("phases") or []
    return {name: round(marks[i + 1][2] - t, 3) for i, (name, _, t) in enumerate(marks[:-1])}


def phase_ops(report, label):
    """The calls a rank made in one phase of its case (see Phases)."""
    marks = report.get("phases") or []
    for index, (name, start, _) in enumerate(marks):
        if name == label:
            end = marks[index + 1][1] if index + 1 < len(marks) else None
            return report["ops"][start:end if end is not None else len(report["ops"])]
    raise KeyError(f"no phase {label!r} (phases: {[m[0] for m in marks]})")


# --------------------------------------------------------------------------- what each rank may see

def coordinates(layout, rank):
    """{"dp": d, "pp": p, "tp": t} of a world rank in init_device_mesh's (dp, pp, tp) layout."""
    dp, pp, tp = layout
    return {"dp": rank // (pp * tp), "pp": rank // tp % pp, "tp": rank % tp}


def rows_of(rows, dp, d):
    """Data-parallel rank d's share of a global batch: the d-th of dp equal consecutive parts."""
    return rows.tensor_split(dp)[d]


def stage_inputs(rows, layout, rank):
    """(inputs, targets) a rank of a (dp, pp, tp) layout is given for one global batch: its dp share's
    inputs on the first stage, its targets on the last, None elsewhere."""
    c = coordinates(layout, rank)
    mine = rows_of(rows, layout[0], c["dp"])
    first, last = c["pp"] == 0, c["pp"] == layout[1] - 1
    return (mine[:, :-1].contiguous() if first else None), (mine[:, 1:].contiguous() if last else None)


def _layout3(layout):
    return tuple(layout) + (1,) * (3 - len(layout))


def own_part(case, rank):
    """What rank `rank` is sent of a case (see the module docstring): a picklable function of the case."""
    kind, public = case["kind"], {k: v for k, v in case.items() if k not in PRIVATE}
    if kind == "block":
        tp = case["tp"]
        x, dy = case["replicas"][rank // tp]
        t = rank % tp
        return dict(public, x=x.tensor_split(tp, dim=1)[t].contiguous(),
                    dy=dy.tensor_split(tp, dim=1)[t].contiguous())
    if kind in ("pipeline", "fsdp"):
        layout = _layout3(case["layout"] if kind == "pipeline" else (case["dp"],))
        inputs, targets = stage_inputs(case["rows"], layout, rank)
        return dict(public, inputs=inputs, targets=targets)
    if kind in ("train", "checkpoint"):
        layouts = case["layouts"]
        which = [0] * len(case["steps"]) if kind == "train" else [
            0 if k < case["split"] else 1 for k in range(len(case["steps"]))]
        if kind == "train":
            return dict(public, batches=[[stage_inputs(rows, layout, rank) for rows in case["steps"]]
                                         for layout in layouts])
        return dict(public, batches=[stage_inputs(rows, layouts[w], rank)
                                     for rows, w in zip(case["steps"], which, strict=True)])
    return public


PRIVATE = ("replicas", "rows", "steps")  # the case's data: only a rank's own share of it travels


# --------------------------------------------------------------------------- inside a rank

class LearnerError(Exception):
    """The learner's code raised: reported by the rank as a value (see raise_first_failure)."""

    def __init__(self, where, what):
        super().__init__(f"{where}: {what}")
        self.where, self.what = where, what


def call(name, fn, *args, **kwargs):
    """fn(*args, **kwargs), a learner function named `name`; its exception becomes a LearnerError."""
    try:
        return fn(*args, **kwargs)
    except (LearnerError, NotImplementedError, KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        raise LearnerError(name, f"{type(exc).__name__}: {exc}") from exc


class Phases:
    """Names the moments of a case and records the rank's calls in them: each mark stores how many calls the
    rank had recorded then (`phase_ops` cuts a report's calls by them).

    While graded, the routed process group reports every call itself (comm.recorder.note_routed_call): the
    rank only counts them, in every phase, so that the router's records of the same calls line up. Elsewhere
    a CommRecorder (a dispatch mode: every tensor operation passes through Python, ~30% of a tensor-parallel
    step here) runs only in the phases marked with record=True."""

    def __init__(self, exercise):
        self.exercise, self.ops, self.marks, self.current = exercise, [], [], None
        self.graded = _routed_world()
        if self.graded:
            self.current = RoutedCounter(exercise=exercise).__enter__()

    def mark(self, label, record=True):
        if not self.graded:
            self._stop()
        count = len(self.current.ops) if self.graded else len(self.ops)
        self.marks.append([label, count, time.perf_counter()])
        if not self.graded and record:
            self.current = CommRecorder(exercise=self.exercise).__enter__()

    def _stop(self):
        if self.current is not None:
            self.current.__exit__(None, None, None)
            self.ops.extend(self.current.ops)
            self.current = None

    def close(self):
        self.marks.append(["end", None, time.perf_counter()])
        if self.graded and self.current is not None:
            self.current.__exit__(None, None, None)
            self.ops.extend(self.current.ops)
            self.current = None
        self._stop()
        return self.ops


class RoutedCounter(CommRecorder):
    """A recorder that only takes the calls the routed process group reports (no dispatch mode)."""

    def __enter__(self):
        comm_recorder._active.append(self)
        return self

    def __exit__(self, *exc):
        if self in comm_recorder._active:
            comm_recorder._active.remove(self)
        return False


def _routed_world():
    try:
        return dist.get_backend() == comm_recorder.ROUTED_BACKEND
    except Exception:  # noqa: BLE001
        return False


@contextlib.contextmanager
def new_groups_wait(seconds):
    """Groups made inside the rank (init_device_mesh's) wait `seconds`, as the world group does: torch gives a
    new gloo group its backend's default (30 minutes), not the world's."""
    import torch.distributed.distributed_c10d as c10d

    default = c10d.default_pg_timeout
    c10d.default_pg_timeout = datetime.timedelta(seconds=seconds)
    try:
        yield
    finally:
        c10d.default_pg_timeout = default


def _rank_side(learner, parts, exercise, group_timeout, folders=()):
    """Each of this rank's parts in turn; the first failure is reported as that case's report and ends the
    rank's cases (its peers would not match the next case's calls)."""
    reports = []
    # what torch's parallel APIs print on a CPU mesh (FSDP2's UserWarning that a module returned a view, the
    # redistribute log line of a 2-D gradient norm) would bury a rank's own output: silenced on purpose
    with quiet_dtensor(), new_groups_wait(group_timeout):
        for part in parts:
            phases = Phases(exercise)
            try:
                try:
                    report = CASES[part["kind"]](learner, part, phases)
                finally:
                    ops = phases.close()
            except NotImplementedError:
                raise  # the launcher names it "not written yet" (the released notebook)
            except Exception as exc:  # noqa: BLE001 - reported as a value, the caller blames
                report = _failure(exc, exercise)
                report["ops"] = _plain_ops(ops)
                reports.append(report)
                break
            report["phases"], report["ops"] = phases.marks, _plain_ops(ops)
            reports.append(to_cpu(report))
    return reports


def _failure(exc, exercise):
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, LearnerError):
        if WAITED.search(exc.what):
            return {"waited": exc.what.splitlines()[0][:300]}
        return {"error": [exc.where, exc.what[:2000]]}
    if isinstance(exc, RuntimeError) and WAITED.search(str(exc)):
        return {"waited": text.splitlines()[0][:300]}
    return {"error": [exercise, text[:2000]]}


def _plain_ops(ops):
    return [o.row() for o in ops]


def _config(part):
    return GPTConfig(**part["config"])


def _dtype(part):
    return getattr(torch, part.get("dtype", "float64"))


def _mesh(layout, names):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(rank_device().type, tuple(layout), mesh_dim_names=names)


def local(tensor):
    """A DTensor's local piece, or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def full(tensor):
    """A DTensor's whole value (a collective over its mesh), or the tensor itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def placements(tensor):
    return [str(p) for p in tensor.placements] if hasattr(tensor, "placements") else None


# -- mesh

def _mesh_case(learner, part, phases):
    dp, pp, tp = part["layout"]
    phases.mark("build", record=False)
    try:
        mesh = learner["make_mesh"](dp, pp, tp)
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - refusing bad sizes is part of the exercise
        return {"raised": [type(exc).__name__, str(exc)[:500]]}
    if not hasattr(mesh, "mesh_dim_names"):
        raise LearnerError("make_mesh", f"returned {type(mesh).__name__}, expected a DeviceMesh")
    names = tuple(mesh.mesh_dim_names or ())
    report = {"names": list(names), "shape": list(mesh.shape), "device": mesh.device_type, "members": {}}
    if mesh.get_coordinate() is None:  # this rank is not in the mesh (torch builds one of fewer ranks)
        report["outside"] = True
        return report
    report.update(mesh=mesh.mesh.tolist(), coords=list(mesh.get_coordinate()))
    for axis in names:
        report["members"][axis] = dist.get_process_group_ranks(mesh[axis].get_group())
    return report


# -- one block, tensor + sequence parallel

def _block_case(learner, part, phases):
    from torch.distributed.tensor.parallel import parallelize_module

    config, tp = _config(part), part["tp"]
    phases.mark("build", record=False)
    mesh = _mesh((dist.get_world_size() // tp, tp), ("dp", "tp"))
    block = block_of(config, part["seed"])
    plan = call("block_plan", learner["block_plan"])
    if not isinstance(plan, dict):
        raise LearnerError("block_plan", f"returned {type(plan).__name__}, expected a dict of styles")
    call("parallelize_module(block, mesh['tp'], block_plan())", parallelize_module, block, mesh["tp"], plan)
    x = part["x"].to(rank_device()).clone().requires_grad_()
    torch.manual_seed(part.get("rng_seed", 0))  # the same generator on every rank: dropout's masks agree
    phases.mark("forward")
    out = call("the parallelized block's forward", block, x)
    report = {"output_placements": placements(out)}
    out = local(out)
    report["output"] = out.detach().clone()
    if out.shape != part["dy"].shape:
        report["grad_skipped"] = True
        return report
    phases.mark("backward")
    call("the parallelized block's backward", out.backward, part["dy"].to(rank_device()))
    phases.mark("gather")
    report["input_grad"] = x.grad.clone() if x.grad is not None else None
    report["params"] = {n: {"placements": placements(p), "local": list(local(p).shape),
                            "grad_placements": placements(p.grad) if p.grad is not None else None}
                        for n, p in block.named_parameters()}
    report["grads"] = {n: (full(p.grad).detach().clone() if p.grad is not None else None)
                       for n, p in block.named_parameters()}
    return report


def block_of(config, seed, dtype=torch.float64):
    """Block 0 of gpt(config, seed): the block the exercise parallelizes, the same on every rank."""
    return gpt(dataclass_replace(config, n_layers=1), seed=seed, dtype=dtype).blocks["0"].to(rank_device())


def dataclass_replace(config, **changes):
    from dataclasses import replace

    return replace(config, **changes)


# -- pipeline stages

def _pipeline_case(learner, part, phases):
    config, layout = _config(part), _layout3(part["layout"])
    phases.mark("build", record=False)
    mesh = _mesh(layout, AXES)
    model = gpt(config, seed=part["seed"], dtype=_dtype(part)).to(rank_device())
    stage = call("cut_stage", learner["cut_stage"], model, mesh["pp"], list(part["costs"]))
    schedule = call("make_schedule", learner["make_schedule"], stage, mesh["pp"], part["n_micro"])
    report = describe_stage(stage, schedule)
    phases.mark("step")
    losses = call("the schedule's step", schedule_step, schedule, mesh["pp"], part["inputs"], part["targets"])
    report["losses"] = [float(v) for v in losses]
    report["grads"] = {n: (p.grad.detach().clone() if p.grad is not None else None)
                       for n, p in stage.named_parameters()}
    return report


def describe_stage(stage, schedule):
    """Plain facts about a stage module and its schedule: which parts of the model it holds, the
    schedule's class, micro-batches, stage index and group."""
    blocks = list(getattr(stage, "blocks", {}) or {})
    report = {"blocks": blocks, "has_embeddings": getattr(stage, "tok", None) is not None,
              "has_head": getattr(stage, "head", None) is not None,
              "schedule": type(schedule).__name__, "n_micro": getattr(schedule, "_n_microbatches", None)}
    pipe = getattr(schedule, "_stage", None)
    if pipe is not None:
        group = getattr(pipe, "group", None)
        report.update(stage_index=getattr(pipe, "stage_index", None),
                      n_stages=getattr(pipe, "num_stages", None),
                      group=dist.get_process_group_ranks(group) if group is not None
                      else list(range(dist.get_world_size())))
    return report


def schedule_step(schedule, pp_mesh, inputs, targets):
    """One step of a torch pipeline schedule on this rank, as its stage asks (the inputs on the first stage,
    the targets on the last); the micro-batches' losses on the last stage, [] elsewhere."""
    first, last = pp_mesh.get_local_rank() == 0, pp_mesh.get_local_rank() == pp_mesh.size() - 1
    losses = []
    if first and last:
        schedule.step(inputs.to(rank_device()), target=targets.to(rank_device()), losses=losses)
    elif first:
        schedule.step(inputs.to(rank_device()))
    elif last:
        schedule.step(target=targets.to(rank_device()), losses=losses)
    else:
        schedule.step()
    return [loss.detach().item() for loss in losses]


# -- fully_shard over data parallel

def _fsdp_case(learner, part, phases):
    config, dp = _config(part), part["dp"]
    phases.mark("build", record=False)
    mesh = _mesh((dp,), ("dp",))
    memory_mark("start")
    model = gpt(config, seed=part["seed"], dtype=_dtype(part)).to(rank_device())
    memory_mark("built")
    stage = call("apply_fsdp", learner["apply_fsdp"], model, mesh["dp"])
    memory_mark("sharded")
    report = {"params": {n: {"placements": placements(p), "local": list(local(p).shape),
                             "mesh": _mesh_ranks(p)} for n, p in stage.named_parameters()}}
    phases.mark("forward")
    loss = call("the sharded model's forward", lambda: lm_loss(stage(part["inputs"].to(rank_device())),
                                                                 part["targets"].to(rank_device())))
    memory_mark("after forward")
    phases.mark("backward")
    call("the sharded model's backward", loss.backward)
    memory_mark("after backward")
    report["loss"] = loss.item()
    phases.mark("gather", record=False)
    report["grads"] = {n: (full(p.grad).detach().clone() if p.grad is not None else None)
                       for n, p in stage.named_parameters()}
    return report


def _mesh_ranks(tensor):
    mesh = getattr(tensor, "device_mesh", None)
    return None if mesh is None else sorted(int(r) for r in mesh.mesh.flatten())


# -- the 3-D step, and checkpoints

def build_3d(learner, config, layout, seed, recipe, n_micro, dtype=torch.float64, layer_costs=None):
    """The whole 3-D set-up from the learner's pieces, in torchtitan's order: the mesh (make_mesh), the
    full model on every rank, this rank's pipeline stage (cut_stage), tensor + sequence parallelism of it
    (parallelize_module with stage_plan, built from the learner's block_plan), fully_shard over dp
    (apply_fsdp), the 1F1B schedule (make_schedule), and the recipe's optimizer and learning-rate schedule.
    Returns a namespace: mesh, stage, schedule, optimizer, lr_schedule, recipe."""
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = call("make_mesh", learner["make_mesh"], *layout)
    model = gpt(config, seed=seed, dtype=dtype).to(rank_device())
    costs = list(layer_costs) if layer_costs is not None else [1.0] * config.n_layers
    stage = call("cut_stage", learner["cut_stage"], model, mesh["pp"], costs)
    if mesh["tp"].size() > 1:
        plan = stage_plan(stage, learner["block_plan"])
        call("parallelize_module(stage, mesh['tp'], stage_plan(stage))", parallelize_module, stage,
             mesh["tp"], plan)
    if mesh["dp"].size() > 1:
        stage = call("apply_fsdp", learner["apply_fsdp"], stage, mesh["dp"])
    schedule = call("make_schedule", learner["make_schedule"], stage, mesh["pp"], n_micro)
    optimizer, lr_schedule = make_optimizer(stage.parameters(), recipe)
    return SimpleNamespace(mesh=mesh, stage=stage, schedule=schedule, optimizer=optimizer,
                           lr_schedule=lr_schedule, recipe=recipe)


def stage_plan(stage, block_plan):
    """The tensor-parallel plan of a whole stage: the learner's block_plan for each of its blocks, and the
    embeddings and head the way torchtitan shards them (vocabulary-parallel embeddings whose output is
    reduce-scattered along the sequence, the final LayerNorm sequence-parallel, the head column-parallel
    with its logits gathered)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    plan = {}
    if stage.tok is not None:
        plan["tok"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
        plan["pos"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if stage.head is not None:
        plan["norm"] = SequenceParallel()
        plan["head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    for name in stage.blocks:
        styles = call("block_plan", block_plan, f"blocks.{name}.")
        if not isinstance(styles, dict):
            raise LearnerError("block_plan", f"returned {type(styles).__name__}, expected a dict of styles")
        plan.update(styles)
    return plan


def local_parameters(stage):
    """{name: [offset, this rank's piece]} of a stage's parameters: where the piece sits in the whole
    parameter (DTensor's own rule, torch.chunk's sizes) and its values -- no collective."""
    out = {}
    for name, p in stage.named_parameters():
        if hasattr(p, "to_local"):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            out[name] = [list(offset), p.to_local().detach().double().clone()]
        else:
            out[name] = [[0] * p.dim(), p.detach().double().clone()]
    return out


def _steps(learner, run, batches, first_step, phases):
    results = []
    for k, (inputs, targets) in enumerate(batches):
        phases.mark(f"step {first_step + k}")
        start = time.perf_counter()
        out = call("train_step", learner["train_step"], run, inputs, targets)
        secs = time.perf_counter() - start
        if not isinstance(out, dict) or not {"loss", "norm", "lr"} <= set(out):
            raise LearnerError("train_step", f"returned {out!r:.200}, expected a dict with loss, norm and lr")
        results.append({key: _number("train_step", key, out[key]) for key in ("loss", "norm", "lr")})
        results[-1]["secs"] = secs
    return results


def _train_case(learner, part, phases):
    config, dtype, reports = _config(part), _dtype(part), []
    for layout, batches in zip(part["layouts"], part["batches"], strict=True):
        layout = tuple(layout)
        phases.mark(f"build {layout}", record=False)
        n_micro = n_micro_for(part, layout)
        run = build_3d(learner, config, layout, part["seed"], part["recipe"], n_micro, dtype)
        results = _steps(learner, run, batches, 0, phases)
        reports.append({"layout": list(layout), "steps": results, "params": local_parameters(run.stage)})
    return {"layouts": reports}


def _number(name, key, value):
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise LearnerError(name, f"returned {key}={value!r:.100}, expected a number") from exc


def n_micro_for(part, layout):
    """Micro-batches of a layout: the case's, at least the pipeline's depth (Schedule1F1B refuses fewer)."""
    return max(part.get("n_micro", 1), layout[1]) if layout[1] > 1 else 1


def _checkpoint_case(learner, part, phases):
    config, dtype = _config(part), _dtype(part)
    first, second = (tuple(layout) for layout in part["layouts"])
    split, path = part["split"], part["path"]
    phases.mark(f"build {first}", record=False)
    run = build_3d(learner, config, first, part["seed"], part["recipe"], n_micro_for(part, first), dtype)
    before = _steps(learner, run, part["batches"][:split], 0, phases)
    phases.mark("save", record=False)
    call("save_checkpoint", learner["save_checkpoint"], run, path)
    del run
    phases.mark(f"build {second}", record=False)
    run = build_3d(learner, config, second, part["seed"], part["recipe"], n_micro_for(part, second), dtype)
    phases.mark("load", record=False)
    call("load_checkpoint", learner["load_checkpoint"], run, path)
    after = _steps(learner, run, part["batches"][split:], split, phases)
    return {"before": before, "after": after, "params": local_parameters(run.stage)}


CASES = {"mesh": _mesh_case, "block": _block_case, "pipeline": _pipeline_case, "fsdp": _fsdp_case,
         "train": _train_case, "checkpoint": _checkpoint_case}
