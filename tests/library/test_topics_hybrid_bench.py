"""dpcourse.topics.hybrid.bench: every layout timed once per round (the warm-up round left out), with
the learner's steps really run, and a prediction for each layout (no timing is asserted)."""

import torch

from dpcourse.topics.hybrid.bench import predictions, time_layouts
from markers import exercise

pytestmark = exercise("hybrid_dp_tp_step", "hybrid_dp_pp_step")

LAYOUTS = {"DP 4 x 1": ("dp_tp", (4, 1)), "DP x PP 2 x 2": ("dp_pp", (2, 2))}


def backward_only_tp_step(model, grid, batch, targets, loss_fn, lr):
    loss_fn(model(batch), targets).backward()       # the model's own collectives only
    return 0.0


def no_op_pp_step(model, cuts, grid, batch, targets, loss_fn, n_micro, lr, pipeline_step):
    return None


def test_each_layout_is_timed_once_per_round():
    times = time_layouts(LAYOUTS, backward_only_tp_step, no_op_pp_step, rounds=2, dtype=torch.float32)
    assert set(times) == set(LAYOUTS) and all(len(ts) == 2 and min(ts) > 0 for ts in times.values())


def test_every_layout_has_a_prediction():
    machine = {"flops": 1e10, "alpha": 5e-4, "beta": 1e9}
    predicted = predictions(LAYOUTS, machine)
    assert set(predicted) == set(LAYOUTS) and all(p["time"] > 0 for p in predicted.values())
    assert predicted["DP x PP 2 x 2"]["pp_comm"] > 0 and predicted["DP 4 x 1"]["pp_comm"] == 0
