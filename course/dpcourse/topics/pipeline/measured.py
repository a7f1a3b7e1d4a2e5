"""Notebook 07's "1F1B keeps at most p - s micro-batches' activations" measured from outside, while graded.

    expect_schedule_memory(run_schedule, schedules)   # in a hidden check, after its other checks

Why: the StageWatch (topics.pipeline.runner) follows the memory of the tensors autograd saves and of
each micro-batch's input and output, from inside the rank; a copy into new memory (a `.clone()` kept
in a list, an activation kept as a numpy array) is not among them. Here two stages run a step of
MICRO micro-batches on activations large enough to show in the process's memory (ACTIVATION: 1024 rows
of 128 float64, 1 MiB), and the stage's module names a moment after each of its forwards
(inside_rank.memory_mark); at each, the rank's zygote measures what the rank holds (as root, everything
charged to its own memory cgroup, shared mappings and its /tmp and /dev/shm included; see
dpcourse.grading.zygote.Probe). The rank never sees those numbers. What a rank held after a
forward, minus what it held before the step, is compared with what the schedule allows: the
micro-batches in flight on that stage times what one of them keeps (KEPT), plus SLACK for buffers in
passing (a gradient being received, a send not yet waited for).

A first step runs unmeasured (the optimizer-free warm-up: gradients allocated, the router's buffers
made), and the rank gives the memory freed since back to the system (glibc's malloc_trim) before
"before", so that what the measured step allocates shows as growth: memory a process frees stays
resident, and would otherwise hide the step's peak behind the warm-up's.

Only while graded (the grader's runner measures; in a notebook this check does nothing). The moments
are named inside the rank, where learner code runs too: a program written to fool the measurement
(removing the module's hooks) is the limit of what a measurement in the learner's process can promise
(README, "What the sandbox does not hide"); a copy kept in a list, a dict or an attribute is seen.
"""

import ctypes
import ctypes.util
import itertools

import torch
import torch.distributed as dist

from dpcourse.backend import rank_device
from dpcourse.comm.cases import Case, run_cases
from dpcourse.runtime.inside_rank import memory_mark
from dpcourse.runtime.launcher import launch_options, observed_memory
from dpcourse.topics.pipeline.stages import layer_stack, make_stage
from dpcourse.toys.models import loss_fn

WIDTH, ROWS, MICRO, SEED = 128, 1024, 12, 7  # ROWS per micro-batch
WIDTHS = [WIDTH, WIDTH, WIDTH, WIDTH, 8]  # Linear, Tanh, Linear, Tanh | Linear, Tanh, Linear
CUTS = [0, 4, 7]
STAGES = len(CUTS) - 1
ACTIVATION = ROWS * WIDTH * 8  # bytes of one (ROWS, WIDTH) float64 activation: 1 MiB
# (ROWS, WIDTH) activations one micro-batch keeps on stage s until its backward: stage 0 the outputs
# of its two Tanh (its input is a slice of the batch, held before the step), stage 1 the activation it
# received and its Tanh's output (its Linear's output is 8 wide). tests/library/test_topics_pipeline_
# measured.py counts them with autograd's saved-tensor hooks.
KEPT = {0: 2, 1: 2}
# buffers in passing: a gradient being received, a message being framed for the router (copies of an
# activation), allocator rounding. Measured (m = 8): the solution's stage 0 peaks at 6.0-6.1 MiB (4 MiB of
# activations), a copy of every output kept aside at 13.1-13.2 MiB; with m = 12 such a copy holds 4 MiB
# more again, so the bound sits ~3 MiB above the solution and ~8 MiB below the copy.
SLACK = 5 * ACTIVATION
MB = 1 << 20


def memory_model():
    """The model the measured step trains (every rank builds it identically)."""
    return layer_stack(WIDTHS, seed=SEED)


def memory_data(device=None):
    """The batch of MICRO micro-batches and its targets."""
    generator = torch.Generator().manual_seed(SEED)
    batch = torch.randn(MICRO * ROWS, WIDTH, generator=generator, dtype=torch.float64)
    targets = torch.randn(MICRO * ROWS, WIDTHS[-1], generator=generator, dtype=torch.float64)
    return batch.to(device or rank_device()), targets.to(device or rank_device())


def _give_back_freed_memory():
    """glibc's malloc_trim(0): free pages go back to the system, so that later growth shows."""
    name = ctypes.util.find_library("c")
    if name:
        try:
            ctypes.CDLL(name).malloc_trim(0)
        except (OSError, AttributeError):
            pass


def schedule_memory_run(run_schedule, schedule, ctx):
    """Rank side (the case runner's per-case function, sent this stage's schedule): a warm-up step, then
    "before", then "after forward i" at each forward of the stage."""
    rank = dist.get_rank()
    stage = make_stage(memory_model(), CUTS, rank, device=rank_device())
    batch, targets = memory_data()
    run_schedule(stage, batch, targets, loss_fn, list(schedule))
    stage.module.zero_grad(set_to_none=False)  # gradients stay allocated: the step adds into them
    _give_back_freed_memory()
    forwards = itertools.count()
    hook = stage.module.register_forward_hook(lambda *_: memory_mark(f"after forward {next(forwards)}"))
    memory_mark("before")
    try:
        run_schedule(stage, batch, targets, loss_fn, list(schedule))
    finally:
        hook.remove()
    return {"forwards": next(forwards)}


def expect_schedule_memory(run_schedule, schedules, what, in_flight, hint):
    """Launch run_schedule on the measured model with `schedules` (one list per stage) and check that
    stage s never held more than in_flight[s] micro-batches' activations (+ SLACK) after a forward.
    Nothing when not graded."""
    with launch_options(measure_memory=True):
        run_cases(schedule_memory_run, run_schedule, STAGES, [Case(parts=[list(s) for s in schedules])],
                  exercise="run_schedule")[0]
    measured = observed_memory()
    if measured is None:
        return
    for rank, memory in enumerate(measured):
        marks = {label: held for label, held, *_ in (memory or {}).get("marks", [])}
        after = [label for label in marks if label.startswith("after forward ")]
        if "before" not in marks or len(after) != MICRO:
            raise AssertionError(f"{what}: rank {rank}: the rank's memory could not be measured (its run "
                                 f"ended early, its stage ran {len(after)} forwards instead of {MICRO}, or "
                                 f"its marks were tampered with)")
        allowed = in_flight[rank] * KEPT[rank] * ACTIVATION + SLACK
        label, held = max(((label, marks[label] - marks["before"]) for label in after), key=lambda x: x[1])
        if held > allowed:
            raise AssertionError(
                f"{what}: rank {rank} (stage {rank} of {STAGES}), m = {MICRO} micro-batches of {ROWS} rows, "
                f"activations of {ACTIVATION / MB:.0f} MiB: {label}, the rank held {held / MB:.1f} MiB more "
                f"than before the step, expected at most {allowed / MB:.1f} MiB ({in_flight[rank]} "
                f"micro-batch(es) in flight x {KEPT[rank] * ACTIVATION / MB:.0f} MiB, + {SLACK / MB:.0f} "
                f"MiB): {(held - allowed) / MB:.1f} MiB more than that -- {hint}")
