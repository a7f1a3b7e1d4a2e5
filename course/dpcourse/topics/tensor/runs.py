"""Run a learner's tensor-parallel operator or module on ranks under the recorder; records back.

    runs = run_operator_cases(copy_to_tp, 4, cases, exercise="copy_to_tp")
    runs[case][rank].output, .input_grad, .forward, .backward      # tensors, and CommOp lists

    runs = run_module_cases(ColumnParallelLinear, 2, cases, exercise="ColumnParallelLinear")
    runs[case][rank].params["weight"], .grads["weight"], .output, .input_grad, .forward, .backward

Why a module: a tensor-parallel piece is graded on what each rank computes forward and
backward *and* on the collectives each direction issues (f: none forward, one all-reduce
backward), on which group. Each rank builds the learner's object itself (test cells never
touch it: docs/authoring.md rule 1), runs forward under one CommRecorder and backward under
another, and returns plain values (tensors, numbers, strings, lists, dicts): what a graded rank
may return. The caller turns them into `RankRun` records. Expected values are computed in the
test cell from the unsharded float64 module (`checks`), never here.

While grading, ranks talk through the grader's router, which logs every call outside the ranks;
the calls each rank recorded (forward and backward, case by case) must then be exactly those
the router saw, so code that hides a collective from the recorder is caught.

A case is a dict:
  operator cases: inputs / grads (one tensor per world rank: its x and the gradient of its
      output), groups (None: the whole world, passed as group=None; else lists of world ranks,
      each rank passing its own group), label;
  module cases: full (a builder name in BUILDERS and its keyword arguments), options (keyword
      arguments of the learner's constructor), x (the full input), input ("replicated": every
      rank gets x; "parallel": rank r gets its slice of x's last dimension), output
      ("replicated" or "parallel": whether each rank's output gradient is the full dy or its
      slice), dy (the full output gradient), groups, label; or, for a layout the constructor must
      refuse, full, options, groups, label and refuse=True (each rank reports what it raised).
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dpcourse.backend import rank_device
from dpcourse.comm.recorder import CommOp, CommRecorder
from dpcourse.runtime.inside_rank import to_cpu
from dpcourse.runtime.launcher import launch, observed_traffic
from dpcourse.runtime.timeouts import TIMEOUTS
from dpcourse.topics.tensor import models
from dpcourse.topics.tensor.shards import row_shard

BUILDERS = {"linear": models.linear, "mlp": models.mlp, "attention": models.self_attention}


@dataclass
class RankRun:
    """What one rank did in one case (built by the caller from the rank's plain report)."""

    rank: int  # world rank
    group: tuple  # world ranks of its tensor-parallel group, in group-rank order
    output: object = None  # what forward returned (detached, on the CPU)
    input_grad: object = None  # the gradient that reached the input x (None: no gradient flowed)
    input_after: object = None  # x after the call (an operator must not change its input)
    forward: list = field(default_factory=list)  # CommOp records of the forward call
    backward: list = field(default_factory=list)  # CommOp records of output.backward(dy)
    params: dict = field(default_factory=dict)  # the module's parameters after the call, by name
    grads: dict = field(default_factory=dict)  # their gradients, by name (None: no gradient)
    no_grad: bool = False  # the output did not require grad: backward could not run
    losses: list = field(default_factory=list)  # training: the loss of every step
    steps: list = field(default_factory=list)  # training: (forward ops, backward ops) of every step
    grad_after: object = None  # operators: the gradient handed to backward, if backward changed it
    views: dict = field(default_factory=dict)  # parameters sharing the unsharded module's memory
    params_before: dict = field(default_factory=dict)  # training: the parameters as built
    refused: object = None  # refusal cases: "ValueError: ..." as the constructor raised it, or None

    @property
    def group_rank(self):
        return self.group.index(self.rank)

    @property
    def group_size(self):
        return len(self.group)


_GROUPS = {}  # inside a rank: the groups already created, by layout (cases often share one)


def make_groups(groups):
    """Create every group of a case (all ranks must call new_group, in the same order); return
    (this rank's group, its members). A layout seen before in this rank reuses its groups."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if groups is None:
        return None, tuple(range(world))
    key = (world, tuple(tuple(members) for members in groups))
    if key not in _GROUPS:
        _GROUPS[key] = [(dist.new_group(list(members)), tuple(members)) for members in groups]
    mine = next(((group, members) for group, members in _GROUPS[key] if rank in members), None)
    if mine is None:
        raise ValueError(f"rank {rank} is in none of the groups {groups}")
    return mine


def _call(exercise, label, fn, *args, members=None, **kwargs):
    """Call learner code; an exception names the exercise, the case and the rank (and, for an index out
    of range in a group smaller than the world, the likely cause: an index taken from the world rank)."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as exc:  # the same on every rank: no race on which rank is named
        raise NotImplementedError(f"{exercise} ({label})") from exc  # the launcher says "not written yet"
    except Exception as exc:
        rank = dist.get_rank()
        if isinstance(exc, IndexError) and members is not None and rank >= len(members):
            # every member whose world rank is past the group's slices fails alike: one message for all
            n = len(members)
            who = f"the ranks of group {list(members)} whose world rank is {n} or more"
            hint = (f"a group of {n} has slices 0 to {n - 1}: was the index the world rank (dist.get_rank()) "
                    f"instead of the rank in the group (dist.get_rank(group))?")
            raise RuntimeError(f"{exercise} ({label}) raised on {who}: {type(exc).__name__}: {exc} -- "
                               f"{hint}") from exc
        raise RuntimeError(f"{exercise} ({label}) raised on rank {rank}: "
                           f"{type(exc).__name__}: {exc}") from exc


def _plain_ops(ops):
    return [[o.op, o.peer, o.nbytes, o.start, o.end, list(o.group) if o.group else None] for o in ops]


def _ops(rows):
    return [CommOp(op, peer, nbytes, start, end, tuple(group) if group else None)
            for op, peer, nbytes, start, end, group in rows or ()]


def _tensor(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else None


def _backward(report, output, dy, exercise, label, members=None):
    """output.backward(dy) under a recorder; what happened goes into the report (and dy, if the
    backward changed the gradient it was handed in place)."""
    if not isinstance(output, torch.Tensor):
        raise RuntimeError(f"{exercise} ({label}) returned {type(output).__name__} on rank "
                           f"{dist.get_rank()}, expected a tensor")
    if not output.requires_grad:
        report["no_grad"] = True
        return
    if output.shape != dy.shape:
        return  # the check reports the output's shape; backward would only raise about it
    before = dy.clone()
    with CommRecorder(exercise=exercise) as rec:
        _call(exercise, label, output.backward, dy, members=members)
    report["backward"] = _plain_ops(rec.ops)
    if not torch.equal(dy, before):
        report["grad_after"] = dy.detach().clone()


def _views(module, full):
    """{parameter name: (elements of the memory it keeps, its own elements)} for the module's parameters
    that share memory with the unsharded module's (a view, not a copy: it keeps the whole weight alive
    and an update of it writes into the unsharded module)."""
    theirs = {p.untyped_storage().data_ptr() for p in full.parameters()}
    return {name: (p.untyped_storage().nbytes() // p.element_size(), p.numel())
            for name, p in module.named_parameters() if p.untyped_storage().data_ptr() in theirs}


def run_operator_cases(op, world_size, cases, *, exercise, group_timeout=TIMEOUTS["test_group"],
                       deadline=None):
    """Launch world_size ranks; in each case rank r calls op(inputs[r], group=...) and backward(grads[r])."""
    reports = launch(_operator_side, world_size, op, cases, exercise, group_timeout=group_timeout,
                     deadline=deadline)
    return _by_case(reports, cases, exercise)


def _operator_side(op, cases, exercise):
    reports = []
    for case in cases:
        group, _ = make_groups(case.get("groups"))
        rank, label = dist.get_rank(), case.get("label", exercise)
        members = _members(case, rank, dist.get_world_size())
        x = case["inputs"][rank].to(rank_device()).clone().requires_grad_()
        with CommRecorder(exercise=exercise) as rec:
            output = _call(exercise, label, op, x, group=group, members=members)
        report = {"forward": _plain_ops(rec.ops), "output": _tensor(output), "input_after": _tensor(x)}
        _backward(report, output, case["grads"][rank].to(rank_device()).clone(), exercise, label, members)
        report["input_grad"] = _tensor(x.grad)
        reports.append(to_cpu(report))
    return reports


def run_module_cases(cls, world_size, cases, *, exercise, group_timeout=TIMEOUTS["test_group"],
                     deadline=None):
    """Launch world_size ranks; each case builds cls(full, group, **options), runs forward and backward."""
    reports = launch(_module_side, world_size, cls, cases, exercise, group_timeout=group_timeout,
                     deadline=deadline)
    return _by_case(reports, cases, exercise)


def _input_of(case, x, group_rank, group_size):
    x = x.to(rank_device())
    return row_shard(x, group_rank, group_size).clone() if case.get("input") == "parallel" else x.clone()


def _module_side(cls, cases, exercise):
    reports = []
    for case in cases:
        group, members = make_groups(case.get("groups"))
        rank, label = dist.get_rank(), case.get("label", exercise)
        name, kwargs = case["full"]
        full = BUILDERS[name](**kwargs)
        if case.get("refuse"):  # a layout the constructor must refuse (N does not divide the features)
            reports.append({"refused": _refusal(cls, full, group, case.get("options", {}))})
            continue
        module = _call(exercise, label, cls, full, group, members=members, **case.get("options", {}))
        views = _views(module, full)
        x = _input_of(case, case["x"], members.index(rank), len(members)).requires_grad_()
        with CommRecorder(exercise=exercise) as rec:
            output = _call(exercise, label, module, x, members=members)
        report = {"forward": _plain_ops(rec.ops), "output": _tensor(output), "views": views}
        dy = case["dy"].to(rank_device())
        if case.get("output") == "parallel":
            dy = row_shard(dy, members.index(rank), len(members))
        _backward(report, output, dy.clone(), exercise, label, members)
        report["input_grad"] = _tensor(x.grad)
        report["params"] = {n: p.detach().clone() for n, p in module.named_parameters()}
        report["grads"] = {n: _tensor(p.grad) for n, p in module.named_parameters()}
        reports.append(to_cpu(report))
    return reports


def _refusal(cls, full, group, options):
    """What the constructor raised ("ValueError: 10 output features ..."), or None if it built a module."""
    try:
        cls(full, group, **options)
    except Exception as exc:  # noqa: BLE001 - the check says which exception was expected
        return f"{type(exc).__name__}: {exc}"
    return None


def run_training(cls, world_size, case, *, exercise, group_timeout=TIMEOUTS["test_group"], deadline=None):
    """Launch world_size ranks that train cls(full, group) with plain SGD for len(case["batches"]) steps.

    case: full, groups, label, lr, batches (a list of (x, target) pairs, one per step; x replicated
    on every rank, requiring grad). The loss, mean squared error against the target, is the same
    on every rank of a group. Returns one RankRun per world rank: params after training, the
    loss of every step, and (forward, backward) CommOp lists of every step.
    """
    reports = launch(_training_side, world_size, cls, case, exercise, group_timeout=group_timeout,
                     deadline=deadline)
    return _by_case([[r] for r in reports], [case], exercise, training=True)[0]  # [case][rank]: every rank


def _training_side(cls, case, exercise):
    group, members = make_groups(case.get("groups"))
    label = case.get("label", exercise)
    name, kwargs = case["full"]
    full = BUILDERS[name](**kwargs)
    module = _call(exercise, label, cls, full, group, members=members, **case.get("options", {}))
    views = _views(module, full)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    losses, steps, first_output = [], [], None
    for x, target in case["batches"]:
        # x requires grad, like the output of the layer below would: backward then runs f's all-reduce
        x, target = x.to(rank_device()).requires_grad_(), target.to(rank_device())
        with CommRecorder(exercise=exercise) as forward:
            output = _call(exercise, label, module, x, members=members)
        if not steps:  # the first step's output: a forward that is wrong from the start is explained by it
            first_output = _tensor(output)
        loss = ((output - target) ** 2).mean()
        with CommRecorder(exercise=exercise) as backward:
            _call(exercise, label, loss.backward, members=members)
        with torch.no_grad():
            for p in module.parameters():
                if p.grad is not None:
                    p -= case["lr"] * p.grad
                    p.grad = None
        losses.append(loss.item())
        steps.append([_plain_ops(forward.ops), _plain_ops(backward.ops)])
    params = {n: p.detach().clone() for n, p in module.named_parameters()}
    return to_cpu({"losses": losses, "steps": steps, "params": params, "params_before": before,
                   "views": views, "output": first_output})


def _members(case, rank, world_size):
    groups = case.get("groups")
    if groups is None:
        return tuple(range(world_size))
    return next(tuple(m) for m in groups if rank in m)


def _run_of(rank, members, report, training):
    run = RankRun(rank, members, output=report.get("output"), input_grad=report.get("input_grad"),
                  input_after=report.get("input_after"), forward=_ops(report.get("forward")),
                  backward=_ops(report.get("backward")), params=dict(report.get("params") or {}),
                  grads=dict(report.get("grads") or {}), no_grad=bool(report.get("no_grad")),
                  grad_after=report.get("grad_after"), views=dict(report.get("views") or {}),
                  params_before=dict(report.get("params_before") or {}), refused=report.get("refused"))
    if training:
        run.losses = [float(v) for v in report.get("losses") or ()]
        run.steps = [(_ops(fw), _ops(bw)) for fw, bw in report.get("steps") or ()]
    return run


def _by_case(per_rank, cases, exercise, training=False):
    """[rank][case] plain reports -> [case][rank] RankRuns, checked against the router's log."""
    world_size = len(per_rank)
    runs = [[_run_of(rank, _members(case, rank, world_size), per_rank[rank][index], training)
             for rank in range(world_size)] for index, case in enumerate(cases)]
    expect_router_agrees(runs, exercise)
    return runs


def _recorded(run):
    ops = run.forward + run.backward
    for forward, backward in run.steps:
        ops += forward + backward
    return ops


def expect_router_agrees(runs, exercise):
    """While grading: every rank's recorded calls, in order, are the ones the grader's router saw."""
    traffic = observed_traffic()
    if traffic is None:
        return
    for rank, seen in enumerate(traffic):
        recorded = [(o.op, o.group) for case_runs in runs for o in _recorded(case_runs[rank])]
        routed = [(o.op, tuple(o.group) if o.group else None) for o in seen if o.op != "barrier"]
        recorded = [(op, group) for op, group in recorded if op != "barrier"]
        if [op for op, _ in recorded] != [op for op, _ in routed]:
            raise AssertionError(
                f"{exercise}: rank {rank} issued {len(routed)} collective(s) as the grader's router saw them "
                f"({', '.join(op for op, _ in routed[:8]) or 'none'}), but recorded {len(recorded)} "
                f"({', '.join(op for op, _ in recorded[:8]) or 'none'}): every collective must go through "
                f"torch.distributed where the recorder sees it")
