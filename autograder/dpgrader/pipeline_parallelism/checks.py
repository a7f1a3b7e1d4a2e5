"""Hidden checks of 07_pipeline_parallelism. Each raises a short AssertionError saying what is wrong.

Yardsticks, all independent of the learner's code:
  * partition_layers: every contiguous partition tried (brute force, at most 8 layers);
  * the pipeline steps: one process running the whole float64 model on the whole batch
    (dpcourse.topics.pipeline.checks.reference_step), the message counts and sizes a pipeline is
    defined by, the activations autograd really kept, and the memory of each finished
    micro-batch's input and output (runner.StageWatch); only the last stage returns a value;
  * one_f_one_b: `reference_one_f_one_b` below, written after Megatron-LM's
    forward_backward_pipelining_without_interleaving (warm-up min(p - s - 1, m) forwards,
    then one forward and one backward, then the remaining backwards), which
    tests/grader/test_pipeline_reference.py checks against the order torch's Schedule1F1B
    really executes.
Hidden cases cover p = 2, 3, 4, m not divisible by p, m = 1, a stage without parameters
(a lone Tanh), stages placed on ranks out of order, and float64.
"""

import itertools
import math
import random
from functools import partial
from itertools import pairwise

import torch

from dpcourse.runtime.timeouts import TIMEOUTS
from dpcourse.topics.pipeline.checks import (
    expect_held,
    expect_order,
    expect_pipeline_step,
    expect_pipeline_traffic,
    expect_released,
    expect_schedule,
)
from dpcourse.topics.pipeline.measured import MICRO as MICRO_MEASURED
from dpcourse.topics.pipeline.measured import STAGES, expect_schedule_memory
from dpcourse.topics.pipeline.runner import PipelineCase, run_pipeline_cases
from dpcourse.topics.pipeline.schedules import gpipe_schedule
from dpcourse.topics.pipeline.stages import layer_stack

# What each exercise's expected values come from (autograder/exercises.json lists them).
REFERENCES = {
    "partition_layers": "every contiguous partition of the layers, tried by brute force",
    "naive_pipeline_step": "one process running the whole float64 model on the whole batch "
                           "(dpcourse.topics.pipeline.checks.reference_step); the messages a pipeline is "
                           "defined by",
    "gpipe_step": "one process running the whole float64 model on the whole batch; the messages of each "
                  "micro-batch; the activations autograd kept (StageWatch)",
    "one_f_one_b": "reference_one_f_one_b (Megatron-LM's warm-up, steady state, cool-down), checked against "
                   "torch's Schedule1F1B",
    "run_schedule": "one process running the whole float64 model on the whole batch; the order a schedule "
                    "lists, the activations autograd kept, and the memory a finished micro-batch still holds "
                    "(StageWatch)",
}

GROUP_TIMEOUT = TIMEOUTS["p2p_deadlock"]

# --------------------------------------------------------------------------- 1. partition_layers


def best_bottleneck(costs, n_stages):
    """The smallest possible cost of the slowest stage, and one partition reaching it (brute force)."""
    n = len(costs)
    best = (math.inf, None)
    for inner in itertools.combinations(range(1, n), n_stages - 1):
        cuts = [0, *inner, n]
        slowest = max(sum(costs[a:b]) for a, b in pairwise(cuts))
        if slowest < best[0]:
            best = (slowest, cuts)
    return best


def _partition_cases():
    rng = random.Random(7)
    cases = [([5], 1), ([1, 1, 1, 1], 4), ([1, 1, 1, 1], 2), ([9, 1, 1, 1, 1, 1], 2), ([1, 1, 1, 1, 1, 9], 3),
             ([0, 0, 3, 0, 0], 2), ([2, 2, 2, 7, 2, 2, 2], 3), ([0.5, 0.25, 0.125, 2.0, 0.0625], 2)]
    for _ in range(60):
        n = rng.randint(1, 8)
        costs = [rng.randint(0, 9) for _ in range(n)] if rng.random() < 0.6 else \
            [round(rng.uniform(0.0, 3.0), 3) for _ in range(n)]
        cases.append((costs, rng.randint(1, n)))
    return cases


def _expect_valid_cuts(cuts, costs, n_stages, call):
    n = len(costs)
    if not isinstance(cuts, (list, tuple)) or not all(isinstance(c, int) for c in cuts):
        raise AssertionError(f"{call} returned {cuts!r}: expected a list of ints, the stage boundaries")
    if len(cuts) != n_stages + 1 or cuts[0] != 0 or cuts[-1] != n:
        raise AssertionError(f"{call} returned {list(cuts)}: expected {n_stages + 1} boundaries from 0 to "
                             f"{n} "
                             f"(stage s runs layers cuts[s] .. cuts[s + 1] - 1)")
    if any(b <= a for a, b in pairwise(cuts)):
        raise AssertionError(f"{call} returned {list(cuts)}: boundaries must increase strictly (every stage "
                             f"runs at least one layer)")


def check_partition_layers(partition_layers):
    for costs, n_stages in _partition_cases():
        call = f"partition_layers({costs}, {n_stages})"
        cuts = partition_layers(list(costs), n_stages)
        _expect_valid_cuts(cuts, costs, n_stages, call)
        best, example = best_bottleneck(costs, n_stages)
        got = max(sum(costs[a:b]) for a, b in pairwise(cuts))
        if got > best + 1e-9:
            raise AssertionError(f"{call} returned {list(cuts)}, whose slowest stage costs {got:g}; the best "
                                 f"partition's slowest stage costs {best:g} (e.g. {example})")
    for costs, n_stages in (([1, 2, 3], 4), ([1, 2], 0)):
        try:
            result = partition_layers(costs, n_stages)
        except ValueError:
            continue
        raise AssertionError(f"partition_layers({costs}, {n_stages}) returned {result!r}: it should raise a "
                             f"ValueError (every one of 1..{len(costs)} stages needs at least one layer)")


# --------------------------------------------------------------------------- pipeline cases

WIDTHS = [8, 12, 10, 16, 6, 3]  # 9 layers: Linear 0, Tanh 1, Linear 2, Tanh 3, ..., Linear 8
# per number of stages: (cuts, placement); stage 1 of the 3-stage pipeline is a lone Tanh (no parameters).
# All cases of a check share one launch of 4 ranks; the ranks outside a case's placement sit it out.
LAYOUTS = {2: ([0, 4, 9], [3, 1]), 3: ([0, 3, 4, 9], [2, 0, 1]), 4: ([0, 2, 5, 8, 9], [3, 1, 0, 2])}
MICRO = {2: (1, 3, 5), 3: (1, 2, 4), 4: (1, 3, 6)}  # m = 1, m not divisible by p, m > p


def _data(rows, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, WIDTHS[0], generator=g, dtype=torch.float64),
            torch.randn(rows, WIDTHS[-1], generator=g, dtype=torch.float64))


def _case(p, rows, seed, placed, **kwargs):
    cuts, placement = LAYOUTS[p]
    X, Y = _data(rows, seed)
    where = f"stages on ranks {placement}" if placed else "stage s on rank s"
    m = kwargs.get("n_micro")
    label = f"{p} stages ({where}), a batch of {rows}" + (f", m = {m}" if m else "")
    return PipelineCase(partial(layer_stack, WIDTHS, seed=seed), cuts, X, Y,
                        placement=placement if placed else None, label=label, **kwargs)


def _run(step, cases, exercise):
    """One launch for every case of a check."""
    return zip(cases, run_pipeline_cases(step, cases, exercise=exercise, group_timeout=GROUP_TIMEOUT),
               strict=True)


# --------------------------------------------------------------------------- 2. naive_pipeline_step


def check_naive_pipeline_step(naive_pipeline_step):
    cases = [_case(p, rows, 70 + p + rows, placed)
             for p in (2, 3, 4) for rows, placed in ((5, False), (1, True))]
    for case, calls in _run(naive_pipeline_step, cases, "naive_pipeline_step"):
        what = f"naive_pipeline_step on {case.label}"
        expect_pipeline_step(calls, case, what)
        expect_pipeline_traffic(calls, case, what)
        expect_order(calls, case, what, [[("F", 0), ("B", 0)]] * case.n_stages)


# --------------------------------------------------------------------------- 3. gpipe_step

GPIPE_RULE = (" (GPipe: all m forwards, then the m backwards in micro-batch order 0, 1, ..., like "
              "ScheduleGPipe)")


def check_gpipe_step(gpipe_step):
    cases = [_case(p, 2 * m, 80 + p + m, placed=(i % 2 == 1), n_micro=m)
             for p in (2, 3, 4) for i, m in enumerate(MICRO[p])]
    for case, calls in _run(gpipe_step, cases, "gpipe_step"):
        what = f"gpipe_step on {case.label}"
        expect_pipeline_step(calls, case, what)
        expect_pipeline_traffic(calls, case, what)
        p, m = case.n_stages, case.micro
        expect_order(calls, case, what, [gpipe_schedule(p, m, s) for s in range(p)], rule=GPIPE_RULE)
        expect_held(calls, case, what, [m] * p,
                    rule=f" (GPipe holds every micro-batch's activations until its backward: m = {m})")


# --------------------------------------------------------------------------- 4. one_f_one_b


def reference_one_f_one_b(n_stages, n_micro, stage):
    """Megatron-LM's non-interleaved 1F1B (PipeDream-flush) order for one stage."""
    warmup = min(n_stages - stage - 1, n_micro)
    remaining = n_micro - warmup
    order, next_forward, next_backward = [], 0, 0
    for _ in range(warmup):
        order.append(("F", next_forward))
        next_forward += 1
    for _ in range(remaining):
        order.append(("F", next_forward))
        next_forward += 1
        order.append(("B", next_backward))
        next_backward += 1
    while next_backward < n_micro:
        order.append(("B", next_backward))
        next_backward += 1
    return order


def check_one_f_one_b(one_f_one_b):
    for p in range(1, 6):
        for m in range(1, 9):
            for s in range(p):
                expect_schedule(one_f_one_b(p, m, s), reference_one_f_one_b(p, m, s),
                                f"one_f_one_b({p}, {m}, {s})",
                                rule=f" ({min(p - s - 1, m)} warm-up forward(s): min(p - s - 1, m), then one "
                                     f"forward and one backward at a time, then the remaining backwards)")


# --------------------------------------------------------------------------- 5. run_schedule

ONE_F_ONE_B_RULE = (" (1F1B: a micro-batch's activations are freed by its backward, which comes at most "
                    "p - s forwards after its own)")


RELEASE_RULE = " (keep each micro-batch's input and output until its backward, and no longer)"


def check_run_schedule(run_schedule):
    cases = [_case(p, 2 * m, 100 + p + m, placed=(i % 2 == 0),
                   schedule=[reference_one_f_one_b(p, m, s) for s in range(p)])
             for p in (2, 3, 4) for i, m in enumerate(MICRO[p])]
    cases.append(_case(3, 8, 110, placed=True, schedule=[gpipe_schedule(3, 4, s) for s in range(3)]))
    for case, calls in _run(run_schedule, cases, "run_schedule"):
        p, m = case.n_stages, case.micro
        gpipe = case.schedule[0] == gpipe_schedule(p, m, 0)
        what = f"run_schedule({'GPipe' if gpipe else '1F1B'} schedule) on {case.label}, m = {m}"
        expect_pipeline_step(calls, case, what)
        expect_pipeline_traffic(calls, case, what)
        expect_order(calls, case, what, case.schedule, rule=" (run the actions in the order given)")
        held = [m] * p if gpipe else [min(p - s, m) for s in range(p)]
        expect_held(calls, case, what, held, at_most=True, rule="" if gpipe else ONE_F_ONE_B_RULE)
        expect_released(calls, case, what, rule=RELEASE_RULE)
    # the same claim measured from outside the rank's objects (a copy kept aside is seen too)
    schedules = [reference_one_f_one_b(STAGES, MICRO_MEASURED, s) for s in range(STAGES)]
    expect_schedule_memory(run_schedule, schedules, "run_schedule(1F1B schedule), memory measured",
                           in_flight=[min(STAGES - s, MICRO_MEASURED) for s in range(STAGES)],
                           hint="a micro-batch's activations are still held after its backward (a copy in a "
                                "list or an attribute, a request never waited for), or more micro-batches "
                                "are in flight than 1F1B allows")
