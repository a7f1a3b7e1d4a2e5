"""Notebook 10's "each rank keeps 1/N" measured from outside the learner's objects, while graded.

    expect_zero1_memory(ShardedOptimizer)          # in a hidden check, after its other checks
    expect_zero2_memory(reduce_scatter_gradients)
    expect_zero3_memory(MiniFSDP)

Why: `held_bytes` (topics.zero.memory) counts what a rank holds by walking the module and the
optimizer, so a ShardedOptimizer that keeps a full copy in an attribute of its own, or a MiniFSDP
that keeps a replica in a list, is not seen. Here each rank trains a model large enough for 1/N to
show in the process's memory (MODEL: 1 million float64 parameters, 8 MB) and names a few
moments (inside_rank.memory_mark: before the learner's class is built, after each step); at each,
the rank's zygote measures what the rank holds (as root, everything charged to the rank's own memory
cgroup: plain memory, shared mappings, files in its /tmp and /dev/shm; see dpcourse.grading.zygote.
Probe). The rank never sees those numbers. What a rank held after a step, minus what it held
before the learner's class existed, is compared with what the stage needs (implementation_bytes:
ZeRO-1 the shard, its gradient and two AdamW states; ZeRO-2 the gradient shard; ZeRO-3 the shards,
their gradients and two states) plus SLACK (3 MiB; measured, a rank is within 0.5 MiB of the need):
a full copy, 8 MB, is well beyond it. What the rank held at "before" is bounded too (BEFORE): memory
set aside by the learner's program cells could otherwise hide a copy made later.

Only while graded (the grader's runner measures; in a notebook these checks do nothing), and only
for launches the check makes itself. The moments are named inside the rank, where learner code runs
too: code written to fool the measurement (patching the run to name its moments early) is the
limit of what a measurement in the learner's process can promise (README, "What the sandbox does
not hide"); a copy held in an attribute, a list or a closure is seen.
"""

import math

import torch

from dpcourse.backend import rank_device
from dpcourse.comm.cases import Case, launch_run, splits
from dpcourse.reference.flat import trainable
from dpcourse.runtime.inside_rank import memory_mark
from dpcourse.runtime.launcher import launch_options, observed_memory
from dpcourse.topics.zero.runs import LR, build_model, global_gradient
from dpcourse.toys.data import global_batch, smooth_regression_data
from dpcourse.toys.models import loss_fn

MODEL = ("deep_mlp", {"depth": 2, "width": 1000})  # 1.0M float64 parameters: 8 MB, 4 MB per rank of 2
WORLD, SEED, STEPS, ROWS = 2, 21, 2, 8
SLACK = 3 << 20  # bytes a rank may hold beyond the stage's need (allocator rounding, small tensors)
MB = 1 << 20


def _memory_case(world_size):
    """Every rank builds the same model and one global batch from fixed seeds: a measurement, not data."""
    return Case(parts=[()] * world_size)


def _batch(device=None):
    X, Y = smooth_regression_data(ROWS, seed=SEED)
    xb, yb = global_batch(X, Y, 0, ROWS)
    return xb.to(device or rank_device()), yb.to(device or rank_device())


@splits(_memory_case)
def zero1_memory_run(ShardedOptimizer, _, ctx):
    """Rank side: marks "before", then "after step s" around ShardedOptimizer's steps (full gradients
    present throughout, as after DDP's averaging)."""
    net = build_model(MODEL, SEED, rank_device())
    xb, yb = _batch()
    global_gradient(net, xb, yb)
    memory_mark("before")
    opt = ShardedOptimizer(net.parameters(), torch.optim.AdamW, lr=LR)
    for step in range(STEPS):
        global_gradient(net, xb, yb)  # the same .grad tensors, refilled: what DDP leaves before step()
        opt.step()
        memory_mark(f"after step {step}")
    return {"numel": sum(p.numel() for p in trainable(net.parameters()))}


@splits(_memory_case)
def zero2_memory_run(reduce_scatter_gradients, _, ctx):
    """Rank side: marks "before" (no gradient yet), then "after step s" once reduce_scatter_gradients
    returned its shard (kept, as the optimizer would)."""
    net = build_model(MODEL, SEED, rank_device())
    xb, yb = _batch()
    memory_mark("before")
    shards = []
    for step in range(STEPS):
        net.zero_grad(set_to_none=True)
        loss_fn(net(xb), yb).backward()
        shards[:] = [reduce_scatter_gradients(net.parameters())]
        memory_mark(f"after step {step}")
    return {"numel": sum(p.numel() for p in trainable(net.parameters()))}


@splits(_memory_case)
def zero3_memory_run(MiniFSDP, _, ctx):
    """Rank side: marks "before" (nothing built yet), then "after step s" between MiniFSDP's AdamW steps."""
    memory_mark("before")
    net = build_model(MODEL, SEED, rank_device())
    numel = sum(p.numel() for p in trainable(net.parameters()))
    fsdp = MiniFSDP(net)
    opt = torch.optim.AdamW([p for p in fsdp.parameters() if p.requires_grad], lr=LR)
    xb, yb = _batch()
    for step in range(STEPS):
        opt.zero_grad()
        loss_fn(fsdp(xb), yb).backward()
        opt.step()
        memory_mark(f"after step {step}")
    return {"numel": numel}


# what a rank holds at "before" beyond its start (the zygote's memory), in full model sizes: the
# learner's program runs before it, and may not set memory aside there to hide a copy in later
BEFORE = {"zero1": (2, "the model and its gradients"), "zero2": (1, "the model"), "zero3": (0, "nothing yet")}
PROGRAM_SLACK = 3 << 20  # what the learner's program (its cells' definitions and imports) may hold (~1 MiB)
# what each stage needs after a step beyond "before", in shards of ⌈S/N⌉ float64 elements
NEEDS = {"zero1": (4, "its shard, the shard's gradient and AdamW's two states"),
         "zero2": (1, "its shard of the averaged gradient"),
         "zero3": (4, "its shards, their gradients and AdamW's two states")}
HINTS = {"zero1": "a full-size copy is kept somewhere (of the parameters, the gradients or the optimizer "
                  "state): ZeRO-1 keeps state for this rank's shard only",
         "zero2": "full gradients are still held somewhere (a list, an attribute): ZeRO-2 keeps only "
                  "this rank's shard once it is reduce-scattered",
         "zero3": "a full copy of the weights (or of their gradients or state) is kept somewhere: "
                  "ZeRO-3 keeps only the shards between steps"}


def _measured(run, stage, learner, what):
    """Launch `run` on WORLD ranks with their memory measured and judge it; nothing when not graded."""
    with launch_options(measure_memory=True):
        results = launch_run(run, WORLD, learner)
    measured = observed_memory()
    if measured is None:
        return
    numel = results[0]["numel"]
    shard = math.ceil(numel / WORLD) * 8
    count, parts = NEEDS[stage]
    allowed = count * shard + SLACK
    for rank, memory in enumerate(measured):
        marks = {label: held for label, held, *_ in (memory or {}).get("marks", [])}
        steps = [f"after step {s}" for s in range(STEPS)]
        if "before" not in marks or any(step not in marks for step in steps):
            raise AssertionError(f"rank {rank}: {what}: the rank's memory could not be measured (its run "
                                 f"ended early, or its marks were tampered with)")
        before = marks["before"] - memory["start_held"]
        models, what_before = BEFORE[stage]
        if before > models * numel * 8 + PROGRAM_SLACK:
            raise AssertionError(
                f"rank {rank}: {what}: before the run's first step the rank already held "
                f"{before / MB:.1f} MiB more than the process it started from, expected {what_before} "
                f"({models * numel * 8 / MB:.1f} MiB) + {PROGRAM_SLACK / MB:.0f} MiB for your notebook's "
                f"definitions: memory set aside by your code before the run counts too")
        for step in steps:
            held = marks[step] - marks["before"]
            if held > allowed:
                raise AssertionError(
                    f"rank {rank}: {what} on a model of {numel / 1e6:.1f}M float64 parameters "
                    f"({numel * 8 / MB:.1f} MiB) over {WORLD} ranks: {step}, the rank held {held / MB:.1f} "
                    f"MiB more than before, expected at most {allowed / MB:.1f} MiB ({parts}: {count} x "
                    f"{shard / MB:.1f} MiB, + {SLACK / MB:.0f} MiB): {(held - allowed) / MB:.1f} MiB more "
                    f"than that -- {HINTS[stage]}")


def expect_zero1_memory(ShardedOptimizer):
    _measured(zero1_memory_run, "zero1", ShardedOptimizer, "ShardedOptimizer")


def expect_zero2_memory(reduce_scatter_gradients):
    _measured(zero2_memory_run, "zero2", reduce_scatter_gradients, "reduce_scatter_gradients")


def expect_zero3_memory(MiniFSDP):
    _measured(zero3_memory_run, "zero3", MiniFSDP, "MiniFSDP")
