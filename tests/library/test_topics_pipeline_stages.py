"""pipeline.stages: a model cut into stages keeps its layers' names; a Stage knows neighbours and widths."""

import time

import pytest
import torch
from torch import nn

from dpcourse.topics.pipeline.stages import (
    SlowLinear,
    boundary_widths,
    check_cuts,
    layer_stack,
    make_stage,
    split_model,
)
from markers import chapter, exercise

pytestmark = chapter("pipeline_parallelism")


def test_layer_stack_numbers_linear_and_tanh_layers_and_is_seeded():
    model = layer_stack([8, 16, 4], seed=3)
    assert [type(m).__name__ for m in model] == ["Linear", "Tanh", "Linear"]
    assert next(model.parameters()).dtype == torch.float64
    same, other = layer_stack([8, 16, 4], seed=3), layer_stack([8, 16, 4], seed=4)
    assert torch.equal(model[0].weight, same[0].weight)
    assert not torch.equal(model[0].weight, other[0].weight)


def test_split_model_keeps_the_whole_models_names():
    model = layer_stack([8, 16, 16, 2])
    stages = split_model(model, [0, 3, 5])
    names = [list(dict(s.named_parameters())) for s in stages]
    assert names == [["0.weight", "0.bias", "2.weight", "2.bias"], ["4.weight", "4.bias"]]
    assert stages[0][0] is model[0]  # the same layers, not copies


@pytest.mark.parametrize("cuts, message", [([0, 2], "end at the number of layers, 5"),
                                           ([1, 5], "start at 0"),
                                           ([0, 2, 2, 5], "strictly increasing")])
def test_bad_cuts_are_explained(cuts, message):
    with pytest.raises(ValueError, match=message):
        check_cuts(cuts, 5)


@exercise("naive_pipeline_step", "gpipe_step", "run_schedule", "hybrid_dp_pp_step")
def test_boundary_widths_and_a_stage_know_what_they_receive_and_send():
    model = layer_stack([8, 12, 6, 3])
    assert boundary_widths(model) == [8, 12, 12, 6, 6, 3]
    stage = make_stage(model, [0, 1, 3, 5], index=1, ranks=[2, 0, 1])
    assert (stage.in_features, stage.out_features) == (12, 6)
    assert (stage.rank, stage.prev, stage.next) == (0, 2, 1)
    assert not stage.is_first and not stage.is_last
    first, last = (make_stage(model, [0, 1, 3, 5], i) for i in (0, 2))
    assert first.prev is None and first.next == 1 and last.next is None and last.is_last
    with pytest.raises(ValueError, match="different ranks"):
        make_stage(model, [0, 1, 3, 5], 0, ranks=[0, 0, 1])


def test_slow_linear_sleeps_and_computes_like_linear():
    torch.manual_seed(0)
    slow = SlowLinear(4, 3, forward_ms=30, backward_ms=60)
    plain = nn.Linear(4, 3)
    plain.load_state_dict(slow.state_dict())
    x = torch.randn(2, 4)
    start = time.perf_counter()
    out = slow(x)
    forward = time.perf_counter() - start
    start = time.perf_counter()
    out.sum().backward()
    backward = time.perf_counter() - start
    plain(x).sum().backward()
    assert forward >= 0.03 and backward >= 0.06
    assert torch.allclose(slow.weight.grad, plain.weight.grad)
