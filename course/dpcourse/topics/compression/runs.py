"""What a rank does in notebook 11's tests: your function on a fixed task, plain results back.

    launch_run(topk_run, 4, topk_all_reduce, grads, 10)    # one dict per rank (grads: a list per rank)

Why a module: the visible tests, the hidden tests and the demos run the learner's code the same
way, and the grader needs them written like this: they are per-case functions of the course's one
case runner (dpcourse.comm.cases, `launch_run`), so each rank is sent its own part only -- its own
gradients, its own share of every batch, worked out in the caller (the asynchronous schedule is
the one run every rank holds whole: the server and the workers all follow it); a run receives the
learner's function as an argument (so it resolves to the learner's code inside each rank), does no
communication of its own (every call on the wire is the learner's, or DDP's own broadcasts in the
PowerSGD run), and returns plain values only; `launch_run` adds the calls, the grader's router's
while graded. While graded, top-k's all-gathers are replayed (comm.provenance.Copies): what a rank
puts in must be its own values (its gradient plus its residual), or what reached it.

The task of the training runs: `data.TASK_MODEL` (float64 MLP) on `data.task_data`, rank r taking
its `my_share` of each global batch, plain SGD (no momentum) with learning rate `lr`.
"""

import torch
import torch.distributed as dist

from dpcourse.backend import rank_device
from dpcourse.comm.cases import Case, launch_run, splits  # noqa: F401 - launch_run is used by 11
from dpcourse.comm.provenance import Copies
from dpcourse.comm.recorder import CommRecorder
from dpcourse.reference.gradients import gradients_of, state_of
from dpcourse.runtime.inside_rank import to_cpu
from dpcourse.topics.compression.data import task_data
from dpcourse.toys.data import global_batch, my_share
from dpcourse.toys.models import MODELS, loss_fn

LR = 0.1


def build_model(model, seed, device=None):
    """The toy `model` ("deep_mlp", or ("deep_mlp", {"width": 5})) initialised from `seed`, float64."""
    name, options = (model, {}) if isinstance(model, str) else model
    return MODELS[name](seed=seed, device=device, **options)


def _pair(result, name, what):
    """The learner's (a, b) result, or a TypeError that says what came back instead."""
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise TypeError(f"{name} must return a pair {what}, got {type(result).__name__}: {str(result)[:120]}")
    return result


def _topk_case(world_size, grads, k, error_feedback=True):
    """Rank r is sent grads[r] only. Replayed while graded: what a rank all-gathers must be made of its
    own gradient plus the residual it carries (the right residual, once the cell's checks passed; or
    that divided by N, averaged before it is sent), or of what reached it."""
    grads = [list(g) for g in grads]
    derived = [[(None, torch.cat([v, v / world_size])) for v in compressed_inputs(g, k, error_feedback)]
               for g in grads]
    return Case(parts=grads, shared={"k": k, "error_feedback": error_feedback},
                replay=Copies(grads, derived=derived))


def compressed_inputs(grads, k, error_feedback=True):
    """What top-k with error feedback compresses at each step: g_t + the residual of step t - 1 (the
    reference's: the k largest magnitudes leave, the rest stays), flattened."""
    residual, out = torch.zeros_like(grads[0]).double(), []
    for g in grads:
        total = g.double() + residual
        out.append(total.reshape(-1).clone())
        kept = total.reshape(-1).abs().topk(min(k, total.numel())).indices
        residual = total.clone().reshape(-1)
        residual[kept] = 0
        residual = residual.reshape(total.shape) if error_feedback else torch.zeros_like(total)
    return out


@splits(_topk_case)
def topk_run(topk_all_reduce, grads, ctx):
    """Rank r calls topk_all_reduce(grads[r][t], residual, k) for t = 0, 1, ...; the residual starts at
    zero and is the one the previous call returned (error_feedback=False: zero at every step).

    Returns {"averages": [per step], "residuals": [per step, as returned]}; launch_run adds "ops".
    """
    k, error_feedback = ctx.shared["k"], ctx.shared["error_feedback"]
    device = rank_device()
    mine = [g.to(device) for g in grads]
    residual = torch.zeros_like(mine[0])
    averages, residuals = [], []
    for g in mine:
        average, new = _pair(topk_all_reduce(g.clone(), residual.clone(), k), "topk_all_reduce",
                             "(average, new_residual)")
        averages.append(average)
        residuals.append(new)
        residual = new.detach().clone() if error_feedback else torch.zeros_like(residual)
    return {"averages": to_cpu(averages), "residuals": to_cpu(residuals)}


def _shares_case(world_size, model, seed, steps, per_rank, *rest, **shared):
    """Rank r is sent its share of every global batch of the task (data.task_data), nothing of the others'."""
    X, Y = task_data(steps, per_rank, world_size, seed)
    parts = [[my_share(X, Y, step, per_rank, rank, world_size, device="cpu") for step in range(steps)]
             for rank in range(world_size)]
    return Case(parts=parts, shared=dict(model=model, seed=seed, steps=steps, per_rank=per_rank, rest=rest,
                                         **shared))


def _powersgd_case(world_size, PowerSGDState, matrix_rank, model, seed, steps, per_rank, lr=LR):
    return _shares_case(world_size, model, seed, steps, per_rank, state=PowerSGDState,
                        matrix_rank=matrix_rank, lr=lr)


@splits(_powersgd_case)
def powersgd_run(powersgd_hook, batches, ctx):
    """DDP with `powersgd_hook` registered (state PowerSGDState(matrix_rank)), `steps` SGD steps on this
    rank's shares.

    Returns, per step, {name: tensor} dicts: "grads" (the gradient the optimizer applied), "local"
    (this rank's own gradient, computed on a copy of the model, without communication) and
    "errors_by_step" (state.errors of each parameter after the step, None if absent); and
    "state" (the final parameters); launch_run adds "ops".
    """
    from torch.nn.parallel import DistributedDataParallel

    device = rank_device()
    net = build_model(ctx.shared["model"], ctx.shared["seed"], device)
    shadow = build_model(ctx.shared["model"], ctx.shared["seed"], device)  # never wrapped: the local gradient
    ctx.phase("setup")  # DDP's own start-up calls (it checks the parameters' shapes on every rank)
    ddp = DistributedDataParallel(net, device_ids=[device] if device.type == "cuda" else None)
    state = ctx.shared["state"](ctx.shared["matrix_rank"])
    ddp.register_comm_hook(state, powersgd_hook)
    ctx.phase("run")
    opt = torch.optim.SGD(net.parameters(), lr=ctx.shared["lr"])
    applied, local, errors = [], [], []
    for xb, yb in _on_device(batches):
        shadow.load_state_dict(net.state_dict())
        shadow.zero_grad(set_to_none=True)
        loss_fn(shadow(xb), yb).backward()
        local.append(gradients_of(shadow))
        opt.zero_grad()
        loss_fn(ddp(xb), yb).backward()
        applied.append(gradients_of(net))
        errors.append(_errors_of(state, net))
        opt.step()
    return {"grads": applied, "local": local, "errors_by_step": errors, "state": state_of(net)}


def _on_device(batches):
    device = rank_device()
    return [tuple(t.to(device) for t in batch) for batch in batches]


def _errors_of(state, net):
    """{name: a copy of state.errors[parameter], or None}: what the learner's state keeps per parameter."""
    kept = getattr(state, "errors", None)
    if not isinstance(kept, dict):
        return {name: None for name, _ in net.named_parameters()}
    out = {}
    for name, p in net.named_parameters():
        value = kept.get(p)
        out[name] = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else None
    return out


def _local_sgd_case(world_size, model, seed, steps, per_rank, H, lr=LR):
    return _shares_case(world_size, model, seed, steps, per_rank, H=H, lr=lr)


@splits(_local_sgd_case)
def local_sgd_run(local_sgd, batches, ctx):
    """local_sgd(model, batches, lr, H) on this rank's shares of `steps` global batches.

    Returns {"state" (after the call)}; launch_run adds "ops".
    """
    net = build_model(ctx.shared["model"], ctx.shared["seed"], rank_device())
    local_sgd(net, _on_device(batches), ctx.shared["lr"], ctx.shared["H"])
    return {"state": state_of(net)}


def async_batches(updates, per_update, seed, device=None):
    """The schedule's batches: update t trains on rows t·per_update ... of the task's data."""
    X, Y = task_data(updates, per_update, 1, seed)
    return [tuple(t.to(device or "cpu") for t in global_batch(X, Y, step, per_update))
            for step in range(updates)]


def _async_case(world_size, model, seed, updates, per_update, delay, lr=LR):
    """The schedule every rank follows (the server and its workers alike): the one run whose data every
    rank holds whole, by design."""
    batches = async_batches(updates, per_update, seed)
    return Case(parts=[batches] * world_size, shared=dict(model=model, seed=seed, delay=delay, lr=lr))


@splits(_async_case)
def async_run(async_sgd, batches, ctx):
    """async_sgd(model, batches, lr, delay) on a server (rank 0) and its workers, every rank holding
    the whole schedule of batches. Returns {"state" (this rank's model after the call), "seen": [(the
    flat parameters, the input rows) at each forward of this rank's model]} -- on a worker, the version
    each of its gradients was computed at, which a test checks against the schedule without trusting
    the server; launch_run adds "ops"."""
    net = build_model(ctx.shared["model"], ctx.shared["seed"], rank_device())
    seen = []

    def note(module, args):
        flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()
        seen.append((flat, args[0].detach().clone() if args and isinstance(args[0], torch.Tensor) else None))

    net.register_forward_pre_hook(note)
    async_sgd(net, _on_device(batches), ctx.shared["lr"], ctx.shared["delay"])
    return {"state": state_of(net), "seen": to_cpu(seen)}


def bucket_orders(model, steps=3, per_rank=4, seed=0):
    """Inside a rank: DDP with a hook that notes (step, bucket index, names of its parameters in bucket
    order) at every call, and all-reduces as DDP would. It shows DDP rebuilding its buckets after the
    first step, in the order the gradients became ready: state kept by position in a bucket would be
    misread from then on."""
    from torch.nn.parallel import DistributedDataParallel

    device = rank_device()
    net = build_model(model, seed, device)
    names = {p: name for name, p in net.named_parameters()}
    seen, now = [], {"step": 0}

    def noting_hook(_, bucket):
        seen.append((now["step"], bucket.index(), [names[p] for p in bucket.parameters()]))
        flat, world_size = bucket.buffer(), dist.get_world_size()
        return dist.all_reduce(flat, async_op=True).get_future().then(lambda fut: fut.value()[0] / world_size)

    ddp = DistributedDataParallel(net, device_ids=[device] if device.type == "cuda" else None)
    ddp.register_comm_hook(None, noting_hook)
    X, Y = task_data(steps, per_rank, dist.get_world_size(), seed)
    for step in range(steps):
        now["step"] = step
        xb, yb = my_share(X, Y, step, per_rank, device=device)
        loss_fn(ddp(xb), yb).backward()
    return seen


def local_sgd_averages(local_sgd, H, steps, model, seed=0, per_rank=4, lr=LR):
    """Inside a rank: your local_sgd(model, batches, lr, H) on `steps` batches, and the steps (1, 2,
    ...) after which it all-reduced, read from the recorder: each call is placed after the number
    of forward passes made before it."""
    device = rank_device()
    net = build_model(model, seed, device)
    X, Y = task_data(steps, per_rank, dist.get_world_size(), seed)
    batches = [my_share(X, Y, step, per_rank, device=device) for step in range(steps)]
    forwards = []
    with CommRecorder() as rec:
        net.register_forward_pre_hook(lambda module, args: forwards.append(len(rec.ops)))
        local_sgd(net, batches, lr, H)
    after = [sum(1 for mark in forwards if mark <= i) for i, o in enumerate(rec.ops) if o.op == "all_reduce"]
    return {"averaged_after": sorted(set(after))}


def averager_steps(period, steps, model, seed=0, per_rank=4, lr=LR):
    """Inside a rank: plain SGD with torch's PeriodicModelAverager(period, warmup_steps=0) called after
    every optimizer step, as its documentation shows. Returns the steps (1, 2, ...) after which it
    all-reduced, from the recorder, and the final parameters."""
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    device = rank_device()
    net = build_model(model, seed, device)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    averager = PeriodicModelAverager(period=period, warmup_steps=0)
    X, Y = task_data(steps, per_rank, dist.get_world_size(), seed)
    averaged = []
    for step in range(1, steps + 1):
        xb, yb = my_share(X, Y, step - 1, per_rank, device=device)
        opt.zero_grad()
        loss_fn(net(xb), yb).backward()
        opt.step()
        with CommRecorder() as rec:
            averager.average_parameters(net.parameters())
        if rec.ops:
            averaged.append(step)
    return {"averaged_after": averaged, "state": state_of(net)}
