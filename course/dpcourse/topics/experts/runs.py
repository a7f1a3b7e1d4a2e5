"""Run a learner's expert-parallel layer on ranks under the recorder; plain results back.

    runs = run_moe_cases(ExpertParallelMoE, 4, cases, exercise="ExpertParallelMoE")
    runs[case][rank].output, .aux_loss, .dropped, .input_grad, .params, .grads, .forward, .backward

Why a module: the visible tests, the hidden checks and the demos of notebook 12 run the layer the
same way. This is its per-case function on the course's one case runner (dpcourse.comm.cases): each
rank is sent its own tokens and their output gradient only, builds ExpertParallelMoE(mixture(**full),
group) itself, runs forward, then backward of sum(y · dy) + aux_loss, and returns plain values
(tensors, numbers; the calls of each direction are the router's while graded). Expected values are
computed by the caller (`checks`) from the single-process layer on each rank's tokens.

A case is a dict: full (mixture's keyword arguments), xs and dys (one (T_r, d_model) tensor per
world rank: its tokens and the gradient of its output; T_r may differ), groups (None: the world),
label.
"""

import torch
import torch.distributed as dist

from dpcourse.backend import rank_device
from dpcourse.comm.cases import Case, run_cases
from dpcourse.comm.operators import parameters_of, tensor_or_none
from dpcourse.runtime.timeouts import TIMEOUTS
from dpcourse.topics.experts.models import mixture

DEFAULTS = {"output": None, "aux_loss": None, "dropped": None, "input_grad": None, "params": {}, "grads": {},
            "no_grad": False}

BACKWARD_ADVICE = (
    "In backward, autograd runs an all-to-all's backward only where its output needs a gradient: a rank "
    "whose experts received no token and whose result does not depend on the (empty) rows it received "
    "skips the all-to-all its peers wait in. Build the experts' results from the received rows even when "
    "there are none (e.g. torch.zeros_like(received).index_copy(0, rows, expert(received[rows])) for every "
    "expert).")


def moe_case(cls, part, ctx):
    """Rank side: the layer on this rank's tokens, forward then backward."""
    x, dy = (t.to(rank_device()).clone() for t in part)
    x.requires_grad_()
    where = f"{ctx.exercise} ({ctx.label})"
    ctx.phase("build")
    layer = ctx.call(cls, mixture(**ctx.shared), ctx.group)
    ctx.phase("forward")
    result = ctx.call(layer, x)
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise RuntimeError(f"{where}: forward must return (y, aux_loss), got {type(result).__name__}")
    y, aux = result
    if not isinstance(y, torch.Tensor) or not isinstance(aux, torch.Tensor):
        raise RuntimeError(f"{where}: forward must return two tensors (y, aux_loss), got "
                           f"({type(y).__name__}, {type(aux).__name__})")
    dropped = getattr(layer, "dropped", None)
    report = {"output": y.detach().clone(), "aux_loss": aux.detach().clone(),
              "dropped": int(dropped) if isinstance(dropped, (int, torch.Tensor)) else None}
    ctx.phase("backward")
    try:
        if y.shape == dy.shape and aux.numel() == 1:
            loss = (y * dy).sum() + aux.reshape(())
            if loss.requires_grad:
                ctx.call(loss.backward)
            else:
                report["no_grad"] = True
        # Every rank of the group is past backward here. A rank that skipped an all-to-all of backward
        # reaches this barrier while a peer still waits in that all-to-all: the grader's router reports the
        # mismatch at once (with gloo it shows as a wait that times out), instead of a deadlock.
        dist.barrier(group=ctx.group)
    except Exception as exc:
        if "barrier" in str(exc):
            raise RuntimeError(f"{where}: the ranks of the group did not make the same all-to-alls in "
                               f"backward. {BACKWARD_ADVICE}") from exc
        raise
    report["input_grad"] = tensor_or_none(x.grad)
    return {**report, **parameters_of(layer)}


def run_moe_cases(cls, world_size, cases, *, exercise, group_timeout=TIMEOUTS["p2p_deadlock"], deadline=None):
    """Launch world_size ranks and run every case on them (see the module docstring); runs[case][rank].

    The group timeout is the course's bound for a deadlock (3 s), not the 5 s of other collectives: the
    all-to-alls here move a few rows, and a rank that skips one in backward (a known trap, see
    BACKWARD_ADVICE) leaves its peers waiting for exactly that long."""
    runnable = [Case(parts=list(zip(c["xs"], c["dys"], strict=True)), shared=dict(c["full"]),
                     groups=c.get("groups"), label=c.get("label"), about=c) for c in cases]
    return run_cases(moe_case, cls, world_size, runnable, exercise=exercise, group_timeout=group_timeout,
                     deadline=deadline, advice=BACKWARD_ADVICE, defaults=DEFAULTS)
