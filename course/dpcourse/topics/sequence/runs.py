"""Run a learner's sequence- or context-parallel code on ranks; plain results and records back.

    runs = run_block_cases(SequenceParallelMLP, 2, cases, exercise="SequenceParallelMLP")
    runs[case][rank].output, .input_grad, .params, .grads, .forward, .backward, .saved

    runs = run_attention_cases(ring_attention, 4, cases, exercise="ring_attention", p2p_only=True)
    runs[case][rank].output, .ops, .flops_at, .flops, .peak, .stuck

Why a module: notebook 12's visible tests, hidden checks and demos run the learner's code the
same way, and the grader needs it written like this: each rank builds the learner's object
itself from a seed, runs it under the recorder and the measurements of `measure`, and returns
plain values; expected values are computed by the caller (`checks`) from the unsharded float64
reference, never in the ranks. Several cases share one launch (a launch costs ~0.2-0.5 s, a case
milliseconds); while grading, the grader's router logs every call outside the ranks, and each
rank's recorded calls must be exactly the ones the router saw (then the router's records,
which the learner's code cannot touch, are the ones the checks read).

Cases (dicts):
  block cases:     full (mlp_block's keyword arguments), x and dy (the whole (seq, batch, d)
                   tensors: rank r gets its contiguous piece of dim 0), groups (None: the world;
                   else lists of world ranks), label
  attention cases: shape (batch, heads, seq, d_head), seeds (of q, k, v), scale (multiplies
                   q and k: large scores test the log-sum-exp rule), positions ("contiguous",
                   "balanced" or a list of position lists), causal, label
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dpcourse.backend import rank_device
from dpcourse.comm.calls import WAITED
from dpcourse.comm.recorder import CommOp, CommRecorder, ForbiddenCollective
from dpcourse.runtime.inside_rank import to_cpu
from dpcourse.runtime.launcher import launch, launch_options, observed_traffic
from dpcourse.runtime.timeouts import TIMEOUTS
from dpcourse.topics.sequence.measure import LayerNormBytes, PeakMemory, StepRecorder
from dpcourse.topics.sequence.models import contiguous_positions, head_tail_positions, inputs, mlp_block
from dpcourse.topics.tensor.runs import RankRun, _views, make_groups


@dataclass
class BlockRun(RankRun):
    """One rank's run of a sequence-parallel block (see tensor.runs.RankRun), plus what its
    LayerNorm kept for backward (measure.LayerNormBytes)."""

    saved: int | None = None
    saved_shapes: list = field(default_factory=list)


@dataclass
class AttentionRun:
    """One rank's call of a context-parallel attention function."""

    rank: int
    positions: object = None  # the positions of its queries (a LongTensor)
    output: object = None
    ops: list = field(default_factory=list)  # CommOp records, the router's while graded
    flops_at: list = field(default_factory=list)  # FLOPs done before each op (same order as ops)
    flops: int = 0  # FLOPs of the whole call (torch's FlopCounterMode)
    peak: int = 0  # peak bytes of the tensors the call created (PeakMemory)
    most_alive: dict = field(default_factory=dict)  # storage size -> the most alive at once (PeakMemory)
    stuck: str | None = None  # a wait that timed out: where
    forbidden: str | None = None  # a collective in a point-to-point exercise


class LearnerError(Exception):
    """The learner's code raised in a rank; the rank reports it (report["error"]) instead of dying, so that
    the caller names the lowest rank that failed -- the same one every time, whatever the timing."""

    def __init__(self, where, what):
        super().__init__(f"{where}: {what}")
        self.where, self.what = where, what


def guarded_call(exercise, label, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        raise LearnerError(f"{exercise} ({label})", f"{type(exc).__name__}: {exc}") from exc


def failure(exc, exercise, label):
    """(kind, report) of an exception in a rank: ("stuck", sentence) for a wait that timed out or a peer
    that left; ("error", [where, what]) for anything else."""
    if isinstance(exc, RuntimeError) and WAITED.search(str(exc)):
        return "stuck", str(exc).splitlines()[0][:300]
    if isinstance(exc, LearnerError):
        if WAITED.search(exc.what):
            return "stuck", exc.what.splitlines()[0][:300]
        return "error", [exc.where, exc.what]
    return "error", [f"{exercise} ({label})", f"{type(exc).__name__}: {exc}"]


def raise_first_error(per_rank, exercise, advice=""):
    """The lowest rank whose learner code raised, as an AssertionError; else a sentence on the ranks
    that waited in vain (a peer stopped early, or the calls did not match), and `advice`."""
    errors = [(rank, r["error"]) for rank, reports in enumerate(per_rank) for r in reports if r.get("error")]
    if errors:
        rank, (where, what) = errors[0]
        raise AssertionError(f"{where} raised on rank {rank}: {what}")
    stuck = sorted({rank for rank, reports in enumerate(per_rank) for r in reports if r.get("waited")})
    if stuck:
        raise AssertionError(f"{exercise}: rank(s) {stuck} waited in vain for their peers (a collective or "
                             f"message no other rank of the group made): every rank of a group must make the "
                             f"same calls in the same order{advice}")


def plain_ops(ops):
    return [[o.op, o.peer, o.nbytes, o.start, o.end, list(o.group) if o.group else None] for o in ops]


def ops_of(rows):
    return [CommOp(op, peer, nbytes, start, end, tuple(group) if group else None)
            for op, peer, nbytes, start, end, group in rows or ()]


# --------------------------------------------------------------------------- the two operators

def run_operator_cases(op, world_size, cases, *, exercise, group_timeout=TIMEOUTS["test_group"],
                       deadline=None):
    """tensor.runs.run_operator_cases (same cases, same RankRun records, for tensor.checks.expect_operator),
    with the learner's exceptions reported by the lowest rank that raised."""
    per_rank = launch(each_case, world_size, _operator_case, op, cases, exercise, group_timeout=group_timeout,
                      deadline=deadline)
    raise_first_error(per_rank, exercise)
    runs = []
    for index, case in enumerate(cases):
        case_runs = []
        for rank in range(world_size):
            report = per_rank[rank][index]
            case_runs.append(RankRun(rank, members_of(case, rank, world_size), output=report.get("output"),
                                     input_grad=report.get("input_grad"),
                                     input_after=report.get("input_after"),
                                     forward=ops_of(report.get("forward")),
                                     backward=ops_of(report.get("backward")),
                                     no_grad=bool(report.get("no_grad"))))
        runs.append(case_runs)
    router_agrees([[run.forward + run.backward for run in case_runs] for case_runs in runs], exercise)
    return runs


def each_case(case_fn, learner, cases, exercise):
    """Rank side of the notebook-12 runners: case_fn(learner, case, exercise) for each case in turn. The
    first failure is reported as what the rank says of that case, and ends its cases: its peers would
    not match the next case's calls."""
    reports = []
    for case in cases:
        try:
            reports.append(case_fn(learner, case, exercise))
        except Exception as exc:
            kind, sentence = failure(exc, exercise, case.get("label", exercise))
            reports.append({"error" if kind == "error" else "waited": sentence})
            break
    return reports


def _operator_case(op, case, exercise):
    group, _ = make_groups(case.get("groups"))
    rank, label = dist.get_rank(), case.get("label", exercise)
    x = case["inputs"][rank].to(rank_device()).clone().requires_grad_()
    with CommRecorder(exercise=exercise) as rec:
        output = guarded_call(exercise, label, op, x, group=group)
    report = {"forward": plain_ops(rec.ops), "input_after": x.detach().clone(),
              "output": output.detach().clone() if isinstance(output, torch.Tensor) else None}
    if not isinstance(output, torch.Tensor):
        raise LearnerError(f"{exercise} ({label})", f"returned {type(output).__name__}, expected a tensor")
    dy = case["grads"][rank].to(rank_device()).clone()
    if not output.requires_grad:
        report["no_grad"] = True
    elif output.shape == dy.shape:
        with CommRecorder(exercise=exercise) as rec:
            guarded_call(exercise, label, output.backward, dy)
        report["backward"] = plain_ops(rec.ops)
    report["input_grad"] = x.grad.clone() if x.grad is not None else None
    return to_cpu(report)


# --------------------------------------------------------------------------- the MLP block

def piece(tensor, index, count):
    """Rank `index`'s contiguous piece of dim 0 (the sequence) out of `count`."""
    return tensor.chunk(count, dim=0)[index]


def run_block_cases(cls, world_size, cases, *, exercise, group_timeout=TIMEOUTS["test_group"], deadline=None):
    """Launch world_size ranks; each case builds cls(mlp_block(**full), group), runs forward on
    the rank's piece of x and backward with its piece of dy. Returns [case][rank] BlockRuns."""
    per_rank = launch(each_case, world_size, _block_case, cls, cases, exercise, group_timeout=group_timeout,
                      deadline=deadline)
    raise_first_error(per_rank, exercise)
    runs = []
    for index, case in enumerate(cases):
        case_runs = []
        for rank in range(world_size):
            report = per_rank[rank][index]
            members = members_of(case, rank, world_size)
            case_runs.append(BlockRun(rank, members, output=report.get("output"),
                                      input_grad=report.get("input_grad"),
                                      forward=ops_of(report.get("forward")),
                                      backward=ops_of(report.get("backward")),
                                      params=report.get("params") or {}, grads=report.get("grads") or {},
                                      no_grad=bool(report.get("no_grad")), saved=report.get("saved"),
                                      views=dict(report.get("views") or {}),
                                      saved_shapes=report.get("saved_shapes") or []))
        runs.append(case_runs)
    router_agrees([[run.forward + run.backward for run in case_runs] for case_runs in runs], exercise)
    return runs


def members_of(case, rank, world_size):
    groups = case.get("groups")
    if groups is None:
        return tuple(range(world_size))
    return next(tuple(m) for m in groups if rank in m)


def _block_case(cls, case, exercise):
    group, members = make_groups(case.get("groups"))
    rank, label = dist.get_rank(), case.get("label", exercise)
    index, count = members.index(rank), len(members)
    full = mlp_block(**case["full"])
    module = guarded_call(exercise, label, cls, full, group)
    x = piece(case["x"], index, count).to(rank_device()).clone().requires_grad_()
    with CommRecorder(exercise=exercise) as rec, LayerNormBytes() as saved:
        output = guarded_call(exercise, label, module, x)
    report = {"forward": plain_ops(rec.ops), "output": output.detach().clone()
              if isinstance(output, torch.Tensor) else None,
              "saved": saved.nbytes, "saved_shapes": saved.shapes, "views": _views(module, full)}
    dy = piece(case["dy"], index, count).to(rank_device()).clone()
    if not isinstance(output, torch.Tensor):
        raise LearnerError(f"{exercise} ({label})", f"returned {type(output).__name__}, expected a tensor")
    if not output.requires_grad:
        report["no_grad"] = True
    elif output.shape == dy.shape:
        with CommRecorder(exercise=exercise) as rec:
            guarded_call(exercise, label, output.backward, dy)
        report["backward"] = plain_ops(rec.ops)
    report["input_grad"] = x.grad.clone() if x.grad is not None else None
    report["params"] = {n: p.detach().clone() for n, p in module.named_parameters()}
    report["grads"] = {n: (p.grad.clone() if p.grad is not None else None)
                       for n, p in module.named_parameters()}
    return to_cpu(report)


# --------------------------------------------------------------------------- attention

def case_positions(case, world_size):
    """The case's split of the sequence: a list of LongTensors, one per rank."""
    layout, seq = case.get("positions", "contiguous"), case["shape"][2]
    if layout == "contiguous":
        return contiguous_positions(seq, world_size)
    if layout == "balanced":
        return head_tail_positions(seq, world_size)
    return [torch.as_tensor(p, dtype=torch.long) for p in layout]


def case_tensors(case):
    """(q, k, v) of the whole sequence, float64 on the CPU: what every rank and the checks rebuild."""
    shape, scale = tuple(case["shape"]), case.get("scale", 1.0)
    sq, sk, sv = case.get("seeds", (1, 2, 3))
    return inputs(shape, sq, scale=scale), inputs(shape, sk, scale=scale), inputs(shape, sv)


def run_attention_cases(fn, world_size, cases, *, exercise, p2p_only=False, group_timeout=None,
                        deadline=None):
    """Launch world_size ranks; in each case rank r calls fn(q_r, k_r, v_r, positions, causal) with
    its rows of q, k, v. Returns [case][rank] AttentionRuns (ops: the router's records while graded).

    p2p_only: collectives are refused (the ring); a rank that waits in vain reports where, and
    stops (its peers then stop too: the launch ends in about the group timeout)."""
    if group_timeout is None:
        group_timeout = TIMEOUTS["p2p_deadlock"] if p2p_only else TIMEOUTS["test_group"]
    with launch_options(p2p_only=p2p_only, exercise=exercise):
        per_rank = launch(_attention_side, world_size, fn, cases, exercise, p2p_only,
                          group_timeout=group_timeout, deadline=deadline)
    raise_first_error(per_rank, exercise)
    runs = []
    for index, case in enumerate(cases):
        positions = case_positions(case, world_size)
        case_runs = []
        for rank in range(world_size):
            report = per_rank[rank][index] if index < len(per_rank[rank]) else {}
            case_runs.append(AttentionRun(rank, positions[rank], output=report.get("output"),
                                          ops=ops_of(report.get("ops")),
                                          flops_at=list(report.get("flops_at") or ()),
                                          flops=int(report.get("flops") or 0),
                                          peak=int(report.get("peak") or 0),
                                          most_alive={int(size): int(count) for size, count
                                                      in report.get("most_alive") or ()},
                                          stuck=report.get("stuck"), forbidden=report.get("forbidden")))
        runs.append(case_runs)
    router_agrees([[run.ops for run in case_runs] for case_runs in runs], exercise, replace=runs)
    return runs


def _attention_side(fn, cases, exercise, p2p_only):
    rank, world_size, reports = dist.get_rank(), dist.get_world_size(), []
    for case in cases:
        positions = case_positions(case, world_size)
        mine = positions[rank]
        q, k, v = (t.index_select(2, mine).to(rank_device()).contiguous() for t in case_tensors(case))
        label = case.get("label", exercise)
        recorder, peak, report = StepRecorder(p2p_only=p2p_only, exercise=exercise), PeakMemory(), {}
        reports.append(report)
        try:
            with recorder, peak:
                output = fn(q, k, v, positions, case.get("causal", False))
            report["output"] = output.detach().clone() if isinstance(output, torch.Tensor) else output
        except ForbiddenCollective as exc:
            report["forbidden"] = str(exc)
        except Exception as exc:
            kind, sentence = failure(exc, exercise, label)
            if kind == "stuck":
                report["stuck"] = _stuck(recorder.ops, world_size)
            else:
                report["error"] = sentence
        report.update(ops=plain_ops(recorder.ops), flops_at=list(recorder.flops_at),
                      flops=recorder.total_flops, peak=peak.peak_bytes,
                      most_alive=sorted(peak.most_alive.items()))
        reports[-1] = to_cpu(report)
        if report.get("stuck") or report.get("forbidden") or report.get("error"):
            break  # peers will not match the next case's calls
    return reports


def _stuck(ops, world_size):
    sends = sum(o.op == "send" for o in ops)
    recvs = sum(o.op in ("recv", "recv_any_source") for o in ops)
    last = f", the last a {ops[-1].op} {'to' if ops[-1].op == 'send' else 'from'} rank {ops[-1].world_peer}" \
        if ops and ops[-1].op in ("send", "recv") else ""
    return f"after {sends} send(s) and {recvs} receive(s){last}"


def router_agrees(recorded, exercise, replace=None):
    """While graded: every rank's recorded calls, in order over the cases, must be the ones the
    grader's router saw; with `replace` ([case][rank] runs with .ops), each run's ops become the
    router's records of the same calls."""
    traffic = observed_traffic()
    if traffic is None:
        return
    for rank, seen in enumerate(traffic):
        routed = [o for o in seen if o.op != "barrier"]
        mine = [o for case_ops in recorded for o in case_ops[rank] if o.op != "barrier"]
        if [o.op for o in routed] != [o.op for o in mine]:
            raise AssertionError(
                f"{exercise}: rank {rank} made {len(routed)} communication call(s) as the grader's router "
                "saw "
                f"them ({', '.join(o.op for o in routed[:8]) or 'none'}), but recorded {len(mine)} "
                f"({', '.join(o.op for o in mine[:8]) or 'none'}): every call must go through "
                f"torch.distributed where the recorder sees it")
        if replace is not None:
            at = 0
            for case_runs in replace:
                count = len([o for o in case_runs[rank].ops if o.op != "barrier"])
                case_runs[rank].ops = routed[at:at + count]
                at += count
