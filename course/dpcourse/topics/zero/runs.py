"""Training runs of notebook 10, inside a rank: your ZeRO classes and torch's, on the same model and data.

    launch(zero1_run, 2, ShardedOptimizer, "deep_mlp", 0, 3, 4)   # -> one plain dict per rank

Why a module: the test cells and the hidden tests train the same way, and the demos put
your code next to torch's `ZeroRedundancyOptimizer` and `fully_shard` on identical runs.
Every run builds `build_model(model, seed)` on the rank's device (a toy of
dpcourse.toys.models by name, or (name, {options}): ("deep_mlp", {"width": 5})) and trains `steps` AdamW
steps (lr=0.01, float64) on global batches of per_rank x N rows of
`smooth_regression_data(steps * per_rank * N, seed=seed)`: rank r takes its `my_share`.
That is exactly what `reference.flat.single_process_run` replays in one process.

Runs return plain values only (state_dicts, flat tensors, CommOp records, numbers), which
the test cell compares with its own reference (dpcourse.topics.zero.checks): nothing here
judges anything.
"""

import torch
import torch.distributed as dist

from dpcourse.comm.recorder import CommRecorder
from dpcourse.reference.flat import flat, trainable
from dpcourse.reference.gradients import state_of
from dpcourse.reference.splits import chunk_bounds
from dpcourse.runtime.backend import rank_device
from dpcourse.topics.zero.memory import held_bytes, optimizer_summary
from dpcourse.topics.zero.units import UnitRecorder
from dpcourse.toys.data import my_share, smooth_regression_data
from dpcourse.toys.models import MODELS, loss_fn

LR = 0.01


def build_model(model, seed, device=None):
    """The toy `model` ("deep_mlp", or ("deep_mlp", {"width": 5})) initialised from `seed`, float64."""
    name, options = (model, {}) if isinstance(model, str) else model
    return MODELS[name](seed=seed, device=device, **options)


def model_label(model):
    """'deep_mlp' or 'deep_mlp(width=5)', for messages."""
    if isinstance(model, str):
        return model
    name, options = model
    return f"{name}({', '.join(f'{k}={v}' for k, v in options.items())})"


def run_data(model, seed, steps, per_rank, world_size=None):
    """(make_model, X, Y) of a run: what ranks train on and what the reference replays."""
    world_size = dist.get_world_size() if world_size is None else world_size
    X, Y = smooth_regression_data(steps * per_rank * world_size, seed=seed)
    return (lambda: build_model(model, seed)), X, Y


def _batches(model, seed, steps, per_rank, rank=None, world_size=None):
    world_size = dist.get_world_size() if world_size is None else world_size
    rank = dist.get_rank() if rank is None else rank
    _, X, Y = run_data(model, seed, steps, per_rank, world_size)
    return [my_share(X, Y, step, per_rank, rank, world_size) for step in range(steps)]


def average_gradients(params):
    """What DDP does between backward and the optimizer: every gradient becomes the average over ranks."""
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def zero1_run(ShardedOptimizer, model, seed, steps, per_rank, explicit_shard=False):
    """ZeRO-1 as ZeroRedundancyOptimizer is used: gradients averaged like DDP, then opt.step().

    explicit_shard=True passes step() this rank's slice of the averaged gradient instead.
    Returns {"state", "optimizer" (optimizer_summary of opt.optimizer), "ops" (per step, in step())}.
    """
    net = build_model(model, seed, rank_device())
    opt = ShardedOptimizer(net.parameters(), torch.optim.AdamW, lr=LR)
    params = trainable(net.parameters())
    start, stop = chunk_bounds(sum(p.numel() for p in params), dist.get_world_size())[dist.get_rank()]
    ops = []
    for xb, yb in _batches(model, seed, steps, per_rank):
        opt.zero_grad()
        loss_fn(net(xb), yb).backward()
        average_gradients(params)
        shard = None
        if explicit_shard:
            shard = torch.cat([p.grad.reshape(-1) for p in params])[start:stop].clone()
        with CommRecorder() as rec:
            opt.step() if shard is None else opt.step(shard)
        ops.append(rec.ops)
    return {"state": state_of(net), "optimizer": optimizer_summary(opt.optimizer), "ops": ops}


def rebuild_average(params, shard):
    """Test scaffolding for reduce_scatter_gradients: every rank's shard back into one averaged
    gradient in every .grad (zeros but your slice, then an all-reduce), so a plain optimizer can
    step. Not ZeRO: it lets a test judge the gradient shards alone."""
    numel = sum(p.numel() for p in params)
    start, stop = chunk_bounds(numel, dist.get_world_size())[dist.get_rank()]
    full = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
    full[start:stop] = shard.detach().reshape(-1)
    dist.all_reduce(full)
    offset = 0
    for p in params:
        p.grad = full[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()


def zero2_run(reduce_scatter_gradients, model, seed, steps, per_rank):
    """reduce_scatter_gradients after each backward; a plain AdamW steps the rebuilt average.

    Returns {"state", "shards" (what it returned, per step), "held" (elements of full gradients
    still in .grad after the call, per step), "ops" (per step, in the call)}. Stops early if a
    returned shard has the wrong size (the test cell says why).
    """
    net = build_model(model, seed, rank_device())
    params = trainable(net.parameters())
    opt = torch.optim.AdamW(params, lr=LR)
    numel = sum(p.numel() for p in params)
    start, stop = chunk_bounds(numel, dist.get_world_size())[dist.get_rank()]
    shards, held, ops = [], [], []
    for xb, yb in _batches(model, seed, steps, per_rank):
        opt.zero_grad()
        loss_fn(net(xb), yb).backward()
        with CommRecorder() as rec:
            shard = reduce_scatter_gradients(net.parameters())
        ops.append(rec.ops)
        held.append(sum(p.grad.numel() for p in params if p.grad is not None))
        shards.append(shard.detach().clone() if isinstance(shard, torch.Tensor) else shard)
        ok = isinstance(shard, torch.Tensor) and shard.numel() == stop - start
        # every rank decides alike (a collective), so no rank waits for one that stopped
        flags = torch.tensor([float(ok)], device=rank_device())
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        if not flags.item():
            break
        rebuild_average(params, shard)
        opt.step()
    return {"state": state_of(net), "shards": shards, "held": held, "ops": ops}


def fsdp_run(MiniFSDP, model, seed, steps, per_rank, groups=None):
    """MiniFSDP(model, group) trained with AdamW over its parameters.

    groups: lists of world ranks, each an independent MiniFSDP group training on the same data
    (rank r takes its share by its rank in its group). Returns {"units": [names], "shards":
    [flat shard per unit, after training], "grads": [shard gradients after the first backward],
    "frozen": {name: tensor} of the parameters left out of the units, "events" (UnitRecorder),
    "ops" (per step, forward + backward), "held" (held_bytes between steps), "group_rank",
    "group_size"}.
    """
    group, rank, size = None, dist.get_rank(), dist.get_world_size()
    if groups is not None:
        for members in groups:
            made = dist.new_group(list(members))
            if dist.get_rank() in members:
                group, rank, size = made, list(members).index(dist.get_rank()), len(members)
    net = build_model(model, seed, rank_device())
    ops, grads = [], None
    with UnitRecorder() as units:
        fsdp = MiniFSDP(net, group)
        units.mark("built")
        opt = torch.optim.AdamW([p for p in fsdp.parameters() if p.requires_grad], lr=LR)
        for step, (xb, yb) in enumerate(_batches(model, seed, steps, per_rank, rank, size)):
            opt.zero_grad()
            with CommRecorder() as rec:
                loss_fn(fsdp(xb), yb).backward()
            ops.append(rec.ops)
            if step == 0:
                grads = [None if s.grad is None else s.grad.detach().clone() for s in fsdp.shards]
            opt.step()
            units.mark(f"step {step}")
    frozen = {name: p.detach().clone() for name, p in net.named_parameters() if not p.requires_grad}
    return {"units": [u.name for u in fsdp.units], "shards": [s.detach().clone() for s in fsdp.shards],
            "grads": grads, "frozen": frozen, "events": units.events, "ops": ops,
            "held": held_bytes(fsdp, opt), "group_rank": rank, "group_size": size}


def ddp_ops(model, seed, per_rank):
    """The communication of one DDP step (every gradient all-reduced), for comparison."""
    net = build_model(model, seed, rank_device())
    (xb, yb), = _batches(model, seed, 1, per_rank)
    loss_fn(net(xb), yb).backward()
    with CommRecorder() as rec:
        average_gradients(trainable(net.parameters()))
    return rec.ops


def flat_parameters(module):
    """The module's trainable parameters as one flat vector (FSDP2's DTensors gathered whole)."""
    values = []
    for p in trainable(module.parameters()):
        values.append(p.full_tensor() if hasattr(p, "full_tensor") else p)
    return flat(values)


def compare_stages(ShardedOptimizer, reduce_scatter_gradients, MiniFSDP=None, model="deep_mlp", seed=0,
                   per_rank=4):
    """One AdamW step of the same model under DDP and each ZeRO stage (your three pieces), on this rank.

    Returns {stage: {"memory": held_bytes right after the optimizer step, "sent": bytes this rank
    sent in the step (ring model, comm.volume)}}, and "numel": the trainable elements. Without
    MiniFSDP, ZeRO-3 is left out.
    """
    from dpcourse.comm.volume import bytes_sent

    (xb, yb), = _batches(model, seed, 1, per_rank)
    out = {}

    def fresh():
        net = build_model(model, seed, rank_device())
        return net, trainable(net.parameters())

    net, params = fresh()
    opt = torch.optim.AdamW(params, lr=LR)
    with CommRecorder() as rec:
        loss_fn(net(xb), yb).backward()
        average_gradients(params)
        opt.step()
    out["DDP"] = {"memory": held_bytes(net, opt), "sent": bytes_sent(rec.ops)}
    for stage in ("ZeRO-1", "ZeRO-2"):
        net, params = fresh()
        opt = ShardedOptimizer(net.parameters(), torch.optim.AdamW, lr=LR)
        with CommRecorder() as rec:
            loss_fn(net(xb), yb).backward()
            if stage == "ZeRO-1":
                average_gradients(params)
                opt.step()
            else:
                opt.step(reduce_scatter_gradients(net.parameters()))
        out[stage] = {"memory": held_bytes(net, opt.optimizer), "sent": bytes_sent(rec.ops)}
    out["numel"] = sum(p.numel() for p in params)
    if MiniFSDP is None:
        return out
    net, params = fresh()
    fsdp = MiniFSDP(net)
    opt = torch.optim.AdamW([p for p in fsdp.parameters() if p.requires_grad], lr=LR)
    with CommRecorder() as rec:
        loss_fn(fsdp(xb), yb).backward()
        opt.step()
    out["ZeRO-3"] = {"memory": held_bytes(fsdp, opt), "sent": bytes_sent(rec.ops)}
    return out
