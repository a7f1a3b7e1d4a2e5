"""The yardsticks of notebook 07's hidden checks and benchmark, checked against PyTorch itself.

* `reference_one_f_one_b` (the order one_f_one_b is graded against) is the order torch's Schedule1F1B
  really executes, recorded by the runner's hooks on each stage, for every m >= p it accepts;
* the tuned executor of `make bench` (dpgrader/pipeline_parallelism/tuned.py) computes the gradients of one
  process, sends exactly a pipeline's messages and holds at most p - s micro-batches;
* the hidden checks refuse wrong answers with a message that names them.
"""

from functools import partial

import pytest
import torch

from dpcourse.topics.pipeline.checks import (
    expect_held,
    expect_order,
    expect_pipeline_step,
    expect_pipeline_traffic,
)
from dpcourse.topics.pipeline.compare import torch_schedule_step
from dpcourse.topics.pipeline.runner import PipelineCase, by_stage, run_pipeline_cases
from dpcourse.topics.pipeline.stages import layer_stack
from dpgrader.pipeline_parallelism.checks import (
    check_one_f_one_b,
    check_partition_layers,
    reference_one_f_one_b,
)
from dpgrader.pipeline_parallelism.tuned import TunedOneFOneB
from markers import exercise

pytestmark = pytest.mark.usefixtures("no_orphans")

MODEL = partial(layer_stack, [4, 8, 8, 8, 3], seed=0)  # 7 layers
CUTS = {2: [0, 3, 7], 3: [0, 2, 4, 7], 4: [0, 2, 4, 6, 7]}


def data(rows):
    g = torch.Generator().manual_seed(rows)
    return torch.randn(rows, 4, generator=g, dtype=torch.float64), torch.randn(rows, 3, generator=g,
                                                                             dtype=torch.float64)


@exercise("one_f_one_b")
@pytest.mark.parametrize("p", [2, 3, 4])
def test_the_reference_1f1b_order_is_what_torchs_schedule1f1b_executes(p):
    cases = [PipelineCase(MODEL, CUTS[p], *data(m), n_micro=m) for m in range(p, p + 3)]
    step = partial(torch_schedule_step, schedule="1F1B")
    for case, calls in zip(cases, run_pipeline_cases(step, cases, exercise="Schedule1F1B"), strict=True):
        for s, call in enumerate(by_stage(calls, case)):
            executed = [(kind, i) for kind, i, *_ in call.observed["events"]]
            assert executed == reference_one_f_one_b(p, case.micro, s), (p, case.micro, s)


def tuned_step(stage, batch, targets, loss_fn, n_micro):
    return TunedOneFOneB(stage, loss_fn, n_micro)(batch, targets)


@exercise("run_schedule")
def test_the_tuned_executor_is_a_correct_1f1b():
    cases = [PipelineCase(MODEL, CUTS[p], *data(2 * m), n_micro=m, placement=list(range(p))[::-1])
             for p, m in ((2, 1), (3, 5), (4, 6))]
    for case, calls in zip(cases, run_pipeline_cases(tuned_step, cases, exercise="tuned"), strict=True):
        p, m = case.n_stages, case.micro
        expect_pipeline_step(calls, case, "tuned")
        expect_pipeline_traffic(calls, case, "tuned")
        expect_order(calls, case, "tuned", [reference_one_f_one_b(p, m, s) for s in range(p)])
        expect_held(calls, case, "tuned", [min(p - s, m) for s in range(p)], at_most=True)


def gpipe_order(n_stages, n_micro, stage):
    return [("F", i) for i in range(n_micro)] + [("B", i) for i in range(n_micro)]


@exercise("one_f_one_b", "partition_layers")
def test_the_hidden_checks_refuse_wrong_answers_by_name():
    with pytest.raises(AssertionError, match=r"one_f_one_b\(1, 2, 0\) returned F0 F1 B0 B1, expected "
                                             r"F0 B0 F1 B1: step 2 is F1 where B0 was expected \(0 warm-up "
                                             r"forward\(s\)"):
        check_one_f_one_b(gpipe_order)
    with pytest.raises(AssertionError, match="whose slowest stage costs"):
        check_partition_layers(lambda costs, p: [round(s * len(costs) / p) for s in range(p + 1)])
