"""What a rank does in notebook 11's tests: your function on a fixed task, plain results back.

    launch_run(topk_run, 4, topk_all_reduce, grads, 10)       # -> one dict per rank

Why a module: the visible tests, the hidden tests and the demos run the learner's code the same
way, and the grader needs them written like this: a run receives the learner's function as an
argument (so it resolves to the learner's code inside each rank), does no communication of its own
(every call on the wire is the learner's, or DDP's own broadcasts in the PowerSGD run), and returns
plain values only -- tensors, numbers, and the calls it recorded as plain lists. `launch_run` turns
those lists back into CommOp records, or, when graded, hands over the grader's own count of the
calls (launcher.observed_traffic), which the learner's code cannot touch.

The task of the training runs: `data.TASK_MODEL` (float64 MLP) on `data.task_data`, rank r taking
its `my_share` of each global batch, plain SGD (no momentum) with learning rate `lr`.
"""

import torch
import torch.distributed as dist

from dpcourse.backend import rank_device
from dpcourse.comm.calls import launch_run  # noqa: F401 - launch_run is used by 11
from dpcourse.comm.calls import plain_ops as plain
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


def topk_run(topk_all_reduce, grads, k, error_feedback=True):
    """Rank r calls topk_all_reduce(grads[r][t], residual, k) for t = 0, 1, ...; the residual starts at
    zero and is the one the previous call returned (error_feedback=False: zero at every step).

    Returns {"averages": [per step], "residuals": [per step, as returned], "ops"}.
    """
    rank, device = dist.get_rank(), rank_device()
    mine = [g.to(device) for g in grads[rank]]
    residual = torch.zeros_like(mine[0])
    averages, residuals = [], []
    with CommRecorder() as rec:
        for g in mine:
            average, new = _pair(topk_all_reduce(g.clone(), residual.clone(), k), "topk_all_reduce",
                                 "(average, new_residual)")
            averages.append(average)
            residuals.append(new)
            residual = new.detach().clone() if error_feedback else torch.zeros_like(residual)
    return {"averages": to_cpu(averages), "residuals": to_cpu(residuals), "ops": plain(rec.ops)}


def powersgd_run(powersgd_hook, PowerSGDState, matrix_rank, model, seed, steps, per_rank, lr=LR):
    """DDP with `powersgd_hook` registered (state PowerSGDState(matrix_rank)), `steps` SGD steps.

    Returns, per step, {name: tensor} dicts: "grads" (the gradient the optimizer applied), "local"
    (this rank's own gradient, computed on a copy of the model, without communication) and
    "errors_by_step" (state.errors of each parameter after the step, None if absent); and
    "state" (the final parameters) and "ops".
    """
    from torch.nn.parallel import DistributedDataParallel

    device = rank_device()
    net = build_model(model, seed, device)
    shadow = build_model(model, seed, device)  # the same model, never wrapped: the local gradient
    ddp = DistributedDataParallel(net, device_ids=[device] if device.type == "cuda" else None)
    state = PowerSGDState(matrix_rank)
    ddp.register_comm_hook(state, powersgd_hook)
    X, Y = task_data(steps, per_rank, dist.get_world_size(), seed)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    applied, local, errors = [], [], []
    with CommRecorder() as rec:
        for step in range(steps):
            xb, yb = my_share(X, Y, step, per_rank, device=device)
            shadow.load_state_dict(net.state_dict())
            shadow.zero_grad(set_to_none=True)
            loss_fn(shadow(xb), yb).backward()
            local.append(gradients_of(shadow))
            opt.zero_grad()
            loss_fn(ddp(xb), yb).backward()
            applied.append(gradients_of(net))
            errors.append(_errors_of(state, net))
            opt.step()
    return {"grads": applied, "local": local, "errors_by_step": errors, "state": state_of(net),
            "ops": plain(rec.ops)}


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


def local_sgd_run(local_sgd, model, seed, steps, per_rank, H, lr=LR):
    """local_sgd(model, batches, lr, H) on this rank's shares of `steps` global batches.

    Returns {"state" (after the call), "ops"}.
    """
    device = rank_device()
    net = build_model(model, seed, device)
    X, Y = task_data(steps, per_rank, dist.get_world_size(), seed)
    batches = [my_share(X, Y, step, per_rank, device=device) for step in range(steps)]
    with CommRecorder() as rec:
        local_sgd(net, batches, lr, H)
    return {"state": state_of(net), "ops": plain(rec.ops)}


def async_batches(updates, per_update, seed, device=None):
    """The schedule's batches: update t trains on rows t·per_update ... of the task's data."""
    X, Y = task_data(updates, per_update, 1, seed)
    return [tuple(t.to(device or "cpu") for t in global_batch(X, Y, step, per_update))
            for step in range(updates)]


def async_run(async_sgd, model, seed, updates, per_update, delay, lr=LR):
    """async_sgd(model, batches, lr, delay) on a server (rank 0) and its workers, every rank holding
    the whole schedule of batches. Returns {"state" (this rank's model after the call), "ops",
    "seen": [(the flat parameters, the input rows) at each forward of this rank's model]} -- on a
    worker, the version each of its gradients was computed at, which a test checks against the
    schedule without trusting the server."""
    device = rank_device()
    net = build_model(model, seed, device)
    batches = async_batches(updates, per_update, seed, device)
    seen = []

    def note(module, args):
        flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()
        seen.append((flat, args[0].detach().clone() if args and isinstance(args[0], torch.Tensor) else None))

    net.register_forward_pre_hook(note)
    with CommRecorder() as rec:
        async_sgd(net, batches, lr, delay)
    return {"state": state_of(net), "ops": plain(rec.ops), "seen": to_cpu(seen)}



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
