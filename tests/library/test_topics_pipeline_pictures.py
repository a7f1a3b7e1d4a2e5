"""pipeline.costs and pipeline.timeline: GPT layer FLOPs as the formula says, measured layer costs, and the
pictures draw without error (the Agg backend; no display)."""

from functools import partial

import matplotlib
import pytest
import torch

from dpcourse.topics.pipeline.costs import gpt_layer_flops, measure_layer_costs, plot_partition, stage_costs
from dpcourse.topics.pipeline.runner import PipelineCase, run_pipeline
from dpcourse.topics.pipeline.schedules import gpipe_schedule, simulate
from dpcourse.topics.pipeline.stages import layer_stack
from dpcourse.topics.pipeline.timeline import compare_timelines, plot_timeline, stage_timelines
from markers import chapter, exercise

matplotlib.use("Agg")


@exercise("partition_layers")
def test_gpt_layer_flops_follow_megatrons_formula():
    names, flops = gpt_layer_flops(n_layers=24, hidden=2048, seq=2048, vocab=50257)
    assert len(names) == len(flops) == 26 and names[0] == "embedding" and names[-1] == "output layer"
    assert flops[0] == 0
    assert flops[1] == 24 * 2048 * 2048 ** 2 + 4 * 2048 ** 2 * 2048  # 2.4e11 per block
    assert flops[-1] / flops[1] == pytest.approx(1.753, abs=1e-3)
    assert stage_costs(flops, [0, 7, 13, 19, 26])[-1] == 6 * flops[1] + flops[-1]  # blocks 18..23 + output


@chapter("pipeline_parallelism")
def test_measured_layer_costs_grow_with_the_work():
    model = layer_stack([64, 512, 8], seed=0, dtype=torch.float32)
    costs = measure_layer_costs(model, torch.randn(256, 64), repeats=3)
    assert len(costs) == 3 and all(c > 0 for c in costs)
    assert max(costs[0], costs[2]) > costs[1]  # a Linear costs more than a Tanh
    assert all(p.grad is None for p in model.parameters())


@exercise("partition_layers", "naive_pipeline_step", "run_schedule")
def test_the_pictures_draw_a_recorded_and_a_simulated_run():
    simulated = simulate([gpipe_schedule(3, 4, s) for s in range(3)])
    ax = plot_timeline(simulated, title="simulated", unit=1, unit_name="")
    assert "idle (hatched) 33% of the step" in ax.get_title()
    X = torch.randn(4, 4, dtype=torch.float64)
    case = PipelineCase(partial(layer_stack, [4, 4, 4], seed=0), [0, 1, 3], X, X, n_micro=2,
                        schedule=gpipe_schedule)
    recorded = stage_timelines(run_pipeline(lambda stage, batch, targets, loss_fn, schedule: None, case,
                                            exercise="nothing"), case)
    assert recorded == [[], []]
    fig = compare_timelines({"a": simulated, "b": simulated})
    assert len(fig.axes) == 2
    plot_partition([1, 2, 3, 4], [0, 2, 4])
