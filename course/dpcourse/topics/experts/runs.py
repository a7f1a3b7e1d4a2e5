"""Run a learner's expert-parallel layer on ranks under the recorder; plain results back.

    runs = run_moe_cases(ExpertParallelMoE, 4, cases, exercise="ExpertParallelMoE")
    runs[case][rank].output, .aux_loss, .dropped, .input_grad, .params, .grads, .forward, .backward

Why a module: the visible tests, the hidden checks and the demos of notebook 12 run the layer the
same way: each rank builds ExpertParallelMoE(mixture(**full), group) itself, runs forward on its
own tokens, then backward of sum(y · dy) + aux_loss, and returns plain values (tensors, numbers,
the calls of each direction as the recorder saw them). Expected values are computed by the
caller (`checks`) from the single-process layer on each rank's tokens. While grading, every
rank's recorded calls must be exactly those the grader's router saw.

A case is a dict: full (mixture's keyword arguments), xs and dys (one (T_r, d_model) tensor per
world rank: its tokens and the gradient of its output; T_r may differ), groups (None: the world),
label.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dpcourse.backend import rank_device
from dpcourse.comm.recorder import CommRecorder
from dpcourse.runtime.inside_rank import to_cpu
from dpcourse.runtime.launcher import launch
from dpcourse.runtime.timeouts import TIMEOUTS
from dpcourse.topics.experts.models import mixture
from dpcourse.topics.sequence.runs import (
    LearnerError,
    each_case,
    guarded_call,
    members_of,
    ops_of,
    plain_ops,
    raise_first_error,
    router_agrees,
)
from dpcourse.topics.tensor.runs import RankRun, make_groups


@dataclass
class MoERun(RankRun):
    """One rank's run of an expert-parallel layer (tensor.runs.RankRun, plus aux_loss and dropped)."""

    aux_loss: object = None  # the aux_loss forward returned
    dropped: int | None = None  # the layer's `dropped` attribute after forward


BACKWARD_ADVICE = (
    ". In backward, autograd runs an all-to-all's backward only where its output needs a gradient: a rank "
    "whose experts received no token and whose result does not depend on the (empty) rows it received "
    "skips the all-to-all its peers wait in. Build the experts' results from the received rows even when "
    "there are none (e.g. torch.zeros_like(received).index_copy(0, rows, expert(received[rows])) for every "
    "expert)")


def run_moe_cases(cls, world_size, cases, *, exercise, group_timeout=TIMEOUTS["p2p_deadlock"], deadline=None):
    """Launch world_size ranks and run every case on them (see the module docstring).

    The group timeout is the course's bound for a deadlock (3 s), not the 5 s of other collectives: the
    all-to-alls here move a few rows, and a rank that skips one in backward (a known trap, see
    BACKWARD_ADVICE) leaves its peers waiting for exactly that long."""
    per_rank = launch(each_case, world_size, _moe_case, cls, cases, exercise, group_timeout=group_timeout,
                      deadline=deadline)
    raise_first_error(per_rank, exercise, advice=BACKWARD_ADVICE)
    runs = []
    for index, case in enumerate(cases):
        case_runs = []
        for rank in range(world_size):
            report = per_rank[rank][index]
            case_runs.append(MoERun(rank, members_of(case, rank, world_size), output=report.get("output"),
                                    input_grad=report.get("input_grad"),
                                    forward=ops_of(report.get("forward")),
                                    backward=ops_of(report.get("backward")),
                                    params=report.get("params") or {},
                                    grads=report.get("grads") or {}, no_grad=bool(report.get("no_grad")),
                                    aux_loss=report.get("aux_loss"), dropped=report.get("dropped")))
        runs.append(case_runs)
    router_agrees([[run.forward + run.backward for run in case_runs] for case_runs in runs], exercise)
    return runs


def _fail(exercise, label, message):
    raise LearnerError(f"{exercise} ({label})", message)


def _moe_case(cls, case, exercise):
    rank = dist.get_rank()
    group, _ = make_groups(case.get("groups"))
    label = case.get("label", exercise)
    layer = guarded_call(exercise, label, cls, mixture(**case["full"]), group)
    x = case["xs"][rank].to(rank_device()).clone().requires_grad_()
    with CommRecorder(exercise=exercise) as forward:
        result = guarded_call(exercise, label, layer, x)
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        _fail(exercise, label, f"forward must return (y, aux_loss), got {type(result).__name__}")
    y, aux = result
    if not isinstance(y, torch.Tensor) or not isinstance(aux, torch.Tensor):
        _fail(exercise, label, f"forward must return two tensors (y, aux_loss), got "
                               f"({type(y).__name__}, {type(aux).__name__})")
    dropped = getattr(layer, "dropped", None)
    report = {"forward": plain_ops(forward.ops), "output": y.detach().clone(),
              "aux_loss": aux.detach().clone(),
              "dropped": int(dropped) if isinstance(dropped, (int, torch.Tensor)) else None}
    dy = case["dys"][rank].to(rank_device())
    where = f"{exercise} ({label})"
    try:
        if y.shape == dy.shape and aux.numel() == 1:
            loss = (y * dy).sum() + aux.reshape(())
            if loss.requires_grad:
                with CommRecorder(exercise=exercise) as backward:
                    guarded_call(exercise, label, loss.backward)
                report["backward"] = plain_ops(backward.ops)
            else:
                report["no_grad"] = True
        # Every rank of the group is past backward here. A rank that skipped an all-to-all of backward
        # reaches this barrier while a peer still waits in that all-to-all: the grader's router reports the
        # mismatch at once (with gloo it shows as a wait that times out), instead of a deadlock.
        dist.barrier(group=group)
    except Exception as exc:
        if "barrier" in str(exc):
            raise LearnerError(where, "the ranks of the group did not make the same all-to-alls in backward"
                                      + BACKWARD_ADVICE) from exc
        raise
    report["input_grad"] = x.grad.clone() if x.grad is not None else None
    report["params"] = {n: p.detach().clone() for n, p in layer.named_parameters()}
    report["grads"] = {n: (p.grad.clone() if p.grad is not None else None)
                       for n, p in layer.named_parameters()}
    return to_cpu(report)
