"""Training runs of notebook 10, inside a rank: your ZeRO classes and torch's, on the same model and data.

    launch_run(zero1_run, 2, ShardedOptimizer, "deep_mlp", 0, 3, 4)   # -> one plain dict per rank

Why a module: the test cells and the hidden tests train the same way, and the demos put
your code next to torch's `ZeroRedundancyOptimizer` and `fully_shard` on identical runs.
Every run builds `build_model(model, seed)` on the rank's device (a toy of
dpcourse.toys.models by name, or (name, {options}): ("deep_mlp", {"width": 5})) and trains `steps` AdamW
steps (lr=0.01, float64) on global batches of per_rank x N rows of
`smooth_regression_data(steps * per_rank * N, seed=seed)`: rank r trains on its `my_share`.
That is exactly what `reference.flat.single_process_run` replays in one process. The runs are
per-case functions of the course's one case runner (dpcourse.comm.cases, `launch_run`): the data
is split in the caller, and each rank is sent its own share of every batch only -- and, where the
scaffolding computes ZeRO-1's averaged gradient itself (zero1_run, zero2_run), the global batches,
which every rank of ZeRO-1 is entitled to.

Runs return plain values only (state_dicts, flat tensors, numbers; launch_run adds the calls),
which the test cell compares with its own reference (dpcourse.topics.zero.checks): nothing here
judges anything. Their scaffolding does not communicate (an averaged gradient is computed
from the whole global batch on each rank), so every call on the wire is the learner's, and
the checks get the grader's own count of them when grading.
"""

import torch
import torch.distributed as dist

from dpcourse.backend import rank_device
from dpcourse.comm import cases
from dpcourse.comm.cases import Case, splits
from dpcourse.comm.provenance import Copies
from dpcourse.comm.recorder import CommRecorder
from dpcourse.reference.flat import flat, trainable
from dpcourse.reference.gradients import state_of
from dpcourse.reference.splits import chunk_bounds
from dpcourse.topics.zero.memory import held_bytes, optimizer_summary
from dpcourse.topics.zero.units import FlatUnit, UnitRecorder
from dpcourse.toys.data import global_batch, my_share, smooth_regression_data
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


FREED = ("out of bounds for storage of size 0", "SIGSEGV")


def explain_crash(error):
    """The sentence to add when a rank used a FlatUnit's freed memory: autograd refuses a saved tensor
    whose storage is empty ("... out of bounds for storage of size 0"), and other reads crash the
    process (SIGSEGV). In MiniFSDP, either means a unit was not gathered before use -- and when
    fsdp_run saw another unit gathered in its place, the hooks are bound to the wrong unit."""
    text = str(error)
    if NOT_GATHERED in text:
        name, _, other = text.split(NOT_GATHERED, 1)[1].split("]", 1)[0].partition("; gathered before it: ")
        if other and other != name and other != "None":
            return (f" -- {name} ran its forward while freed, and the unit gathered just before it was "
                    f"{other}: the hooks gather the wrong unit. A lambda created in a loop looks its "
                    f"variables up when it runs, so every hook sees the loop's last unit; bind each hook to "
                    f"its own with default arguments (lambda module, args, unit=unit, shard=shard: ...)")
    if not any(sign in text for sign in FREED) and NOT_GATHERED not in text:
        return ""
    return (" -- a unit's parameters were used while freed (their memory is 0 bytes). Gather a unit "
            "(unit.alloc() and the all-gather) before its forward and again before its backward")


def launch_run(run, world_size, learner, *args, **kwargs):
    """comm.cases.launch_run, with a diagnosis of freed FlatUnit memory (explain_crash)."""
    return cases.launch_run(run, world_size, learner, *args, explain=explain_crash, **kwargs)


def run_data(model, seed, steps, per_rank, world_size):
    """(make_model, X, Y) of a run: what ranks train on and what the reference replays."""
    X, Y = smooth_regression_data(steps * per_rank * world_size, seed=seed)
    return (lambda: build_model(model, seed)), X, Y


def shares(X, Y, steps, per_rank, rank, world_size):
    """Rank `rank`'s share of every global batch (caller side: what that rank is sent)."""
    return [my_share(X, Y, step, per_rank, rank, world_size, device="cpu") for step in range(steps)]


def global_batches(X, Y, steps, per_rank, world_size):
    return [global_batch(X, Y, step, per_rank * world_size) for step in range(steps)]


def _on_device(batches):
    device = rank_device()
    return [tuple(t.to(device) for t in batch) for batch in batches]


def average_gradients(params):
    """What DDP does between backward and the optimizer: every gradient becomes the average over ranks."""
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def global_gradient(net, xb, yb):
    """Every .grad set to the gradient of the whole global batch, computed on this rank alone.

    The same numbers DDP's averaging gives (the mean over B samples is the mean of the N shard
    means), without communication: a test's scaffolding then leaves the learner's calls alone on
    the wire.
    """
    net.zero_grad(set_to_none=True)
    loss_fn(net(xb), yb).backward()


def _run_case(world_size, model, seed, steps, per_rank, parts, **shared):
    return Case(parts=parts, shared=dict(model=model, seed=seed, steps=steps, per_rank=per_rank, **shared))


def reference_steps(model, seed, steps, per_rank, world_size):
    """Per step of the run every rank must reproduce (one process, the global batch, AdamW): (the flat
    trainable parameters after the step, [each rank's flat gradient of its own share at the step's
    start]). What ZeRO's collectives must carry: updated shards of the former, pieces of the latter."""
    make, X, Y = run_data(model, seed, steps, per_rank, world_size)
    net = make()
    params = trainable(net.parameters())
    opt = torch.optim.AdamW(params, lr=LR)
    out = []
    for step in range(steps):
        local = []
        for rank in range(world_size):
            xb, yb = my_share(X, Y, step, per_rank, rank, world_size, device="cpu")
            net.zero_grad(set_to_none=True)
            loss_fn(net(xb), yb).backward()
            local.append(flat([p.grad for p in params]))
        opt.zero_grad()
        global_gradient(net, *global_batch(X, Y, step, per_rank * world_size))
        opt.step()
        out.append((flat(params), local))
    return out


def _zero1_case(world_size, model, seed, steps, per_rank, explicit_shard=False):
    """Every rank is sent the global batches (see the module docstring). Replayed while graded: what a
    rank all-gathers must be its updated shard (values of the reference's parameters after a step; a
    zero or so of padding), or what reached it."""
    _, X, Y = run_data(model, seed, steps, per_rank, world_size)
    every = global_batches(X, Y, steps, per_rank, world_size)
    params = torch.cat([p for p, _ in reference_steps(model, seed, steps, per_rank, world_size)])
    case = _run_case(world_size, model, seed, steps, per_rank, [every] * world_size, explicit=explicit_shard)
    case.replay = Copies([None] * world_size, derived=[[(None, params)]] * world_size, slack=1)
    return case


@splits(_zero1_case)
def zero1_run(ShardedOptimizer, batches, ctx):
    """ZeRO-1 as ZeroRedundancyOptimizer is used: after the gradients are averaged, opt.step().

    Sent the global batches (ZeRO-1's averaged gradient, which every rank holds), from which
    `global_gradient` computes it without communication, so every call on the wire is the learner's.
    explicit=True passes step() this rank's slice of it instead, as ZeRO-2 does, with every p.grad set
    to None first (reduce_scatter_gradients frees them): a step that ignores its argument and reads the
    .grads then has nothing to read.
    Returns {"state", "optimizer" (optimizer_summary of opt.optimizer), "explicit", and "step_error"
    ("Type: message") when an explicit step() raised}; launch_run adds "ops" (the whole run).
    """
    model, seed, explicit_shard = ctx.shared["model"], ctx.shared["seed"], ctx.shared["explicit"]
    net = build_model(model, seed, rank_device())
    params = trainable(net.parameters())
    start, stop = chunk_bounds(sum(p.numel() for p in params), dist.get_world_size())[dist.get_rank()]
    step_error = None
    opt = ShardedOptimizer(net.parameters(), torch.optim.AdamW, lr=LR)
    for xb, yb in _on_device(batches):
        opt.zero_grad()
        global_gradient(net, xb, yb)
        if explicit_shard:
            shard = torch.cat([p.grad.reshape(-1) for p in params])[start:stop].clone()
            for p in params:
                p.grad = None
            try:
                opt.step(shard)
            except Exception as exc:  # noqa: BLE001 - reported: a step that reads the freed .grads
                step_error = f"{type(exc).__name__}: {exc}"[:300]
                break
        else:
            opt.step()
    return {"state": state_of(net), "optimizer": optimizer_summary(opt.optimizer, list(net.parameters())),
            "explicit": explicit_shard, "step_error": step_error}


def _zero2_case(world_size, model, seed, steps, per_rank):
    """Rank r is sent its shares, and the global batches its scaffolding steps with. Replayed while graded:
    what a rank reduce-scatters must be its own gradient (of its share; or that divided by N), padded."""
    _, X, Y = run_data(model, seed, steps, per_rank, world_size)
    every = global_batches(X, Y, steps, per_rank, world_size)
    reference = reference_steps(model, seed, steps, per_rank, world_size)
    mine = [torch.cat([local[rank] for _, local in reference]) for rank in range(world_size)]
    case = _run_case(world_size, model, seed, steps, per_rank,
                     [(shares(X, Y, steps, per_rank, r, world_size), every) for r in range(world_size)])
    derived = [[(None, torch.cat([g, g / world_size]))] for g in mine]
    case.replay = Copies([None] * world_size, derived=derived, slack=1)
    return case


@splits(_zero2_case)
def zero2_run(reduce_scatter_gradients, part, ctx):
    """reduce_scatter_gradients after each backward on this rank's share of the batch.

    What it returns is judged, not used: a plain AdamW steps the global gradient computed here from the
    global batches (no communication), so each step's input is the reference's. Returns {"shards"
    (what it returned, per step), "held" (elements of full gradients still in .grad after the call, per
    step)}; launch_run adds "ops" (the whole run).
    """
    mine, every = part
    net = build_model(ctx.shared["model"], ctx.shared["seed"], rank_device())
    params = trainable(net.parameters())
    opt = torch.optim.AdamW(params, lr=LR)
    shards, held = [], []
    for (xb, yb), (gx, gy) in zip(_on_device(mine), _on_device(every), strict=True):
        opt.zero_grad()
        loss_fn(net(xb), yb).backward()
        shard = reduce_scatter_gradients(net.parameters())
        held.append(sum(p.grad.numel() for p in params if p.grad is not None))
        shards.append(shard.detach().clone() if isinstance(shard, torch.Tensor) else shard)
        global_gradient(net, gx, gy)
        opt.step()
    return {"shards": shards, "held": held}


def _fsdp_case(world_size, model, seed, steps, per_rank, groups=None, accumulate=1):
    parts = []
    for rank in range(world_size):
        members = cases.members_of(groups, rank, world_size)
        _, X, Y = run_data(model, seed, steps, per_rank, len(members))
        parts.append(shares(X, Y, steps, per_rank, members.index(rank), len(members)))
    return Case(parts=parts, groups=groups,
                shared=dict(model=model, seed=seed, steps=steps, per_rank=per_rank, accumulate=accumulate))


@splits(_fsdp_case)
def fsdp_run(MiniFSDP, batches, ctx):
    """MiniFSDP(model, group) trained with AdamW over its parameters, on this rank's shares.

    groups: lists of world ranks, each an independent MiniFSDP group training on the same data
    (rank r is sent its share by its rank in its group). accumulate: backward passes per step, each
    on an equal part of the rank's share with its loss divided by `accumulate` (gradient
    accumulation: the shard gradients must add up). Returns {"units": [names], "shards": [flat
    shard per unit, after training], "grads": [shard gradients after the first step's backward
    passes], "gathered": [each unit's flat parameters as its first forward saw them, None if it was
    not gathered], "frozen": {name: tensor} of the parameters left out of the units, "events"
    (UnitRecorder), "held" (held_bytes between steps), "group_rank", "group_size", "accumulate"};
    launch_run adds "ops" (the whole run).
    A forward that runs on a unit that is not gathered raises with what was gathered instead
    (`not_gathered`), for the test to name the cause.
    """
    group, rank, size = ctx.group, ctx.group_rank, ctx.group_size
    accumulate = ctx.shared["accumulate"]
    net = build_model(ctx.shared["model"], ctx.shared["seed"], rank_device())
    grads = None
    with UnitRecorder() as units:
        fsdp = MiniFSDP(net, group)
        units.mark("built")
        watch = _GatherWatch(fsdp, units)
        opt = torch.optim.AdamW([p for p in fsdp.parameters() if p.requires_grad], lr=LR)
        for step, (xb, yb) in enumerate(_on_device(batches)):
            opt.zero_grad()
            for x, y in zip(xb.chunk(accumulate), yb.chunk(accumulate), strict=True):
                try:
                    loss = loss_fn(fsdp(x), y) / accumulate
                except RuntimeError as exc:
                    raise RuntimeError(f"{exc}{watch.not_gathered()}") from None
                loss.backward()
            if step == 0:
                grads = [None if s.grad is None else s.grad.detach().clone() for s in fsdp.shards]
            opt.step()
            units.mark(f"step {step}")
            watch.first = False
    frozen = {name: p.detach().clone() for name, p in net.named_parameters() if not p.requires_grad}
    return {"units": [u.name for u in fsdp.units], "shards": [s.detach().clone() for s in fsdp.shards],
            "grads": grads, "gathered": watch.gathered, "frozen": frozen, "events": units.events,
            "held": held_bytes(fsdp, opt), "group_rank": rank, "group_size": size, "accumulate": accumulate}


NOT_GATHERED = " [not gathered: "  # how fsdp_run marks a forward that ran on a freed unit


class _GatherWatch:
    """Forward pre-hooks registered after the learner's (so they run after its gather): note, per
    unit, the flat parameters its first forward sees, and which unit, if any, was gathered instead
    of a unit about to run freed -- the mark of hooks bound to the wrong unit."""

    def __init__(self, fsdp, units):
        self.first, self.units, self.missed = True, units, None
        self.gathered = [None] * len(fsdp.units)
        for index, unit in enumerate(fsdp.units):
            if isinstance(unit, FlatUnit):  # anything else is judged by the test, not watched here
                unit.module.register_forward_pre_hook(lambda module, args, index=index, unit=unit:
                                                      self._seen(index, unit))

    def _seen(self, index, unit):
        if unit.unsharded:
            if self.first and self.gathered[index] is None:
                self.gathered[index] = unit.buffer.detach().clone()
            return
        if self.missed is None:
            allocs = [name for what, name, _, _ in self.units.events if what == "alloc"]
            self.missed = (unit.name, allocs[-1] if allocs else None)

    def not_gathered(self):
        """' [not gathered: fc0; gathered before it: head]', or '' when every unit was gathered."""
        if self.missed is None:
            return ""
        name, last = self.missed
        return f"{NOT_GATHERED}{name}; gathered before it: {last}]"


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

    _, X, Y = run_data(model, seed, 1, per_rank, dist.get_world_size())
    (xb, yb), = _on_device(shares(X, Y, 1, per_rank, dist.get_rank(), dist.get_world_size()))
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
