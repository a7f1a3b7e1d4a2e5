"""Notebook 13's rank side and verdicts (dpcourse.topics.gpt_in_3d): what each rank is sent of a case, the
mesh's layout, pieces of parameters against the whole, the planner's formulas, the pictures."""

import matplotlib
import pytest
import torch
import torch.distributed as dist

from dpcourse.comm.recorder import CommOp
from dpcourse.reference.lm import Recipe, batches_of
from dpcourse.topics.gpt_in_3d.checks import bytes_per_group, expect_mesh, expect_parameters, expected_mesh
from dpcourse.topics.gpt_in_3d.costs import cluster, predict
from dpcourse.topics.gpt_in_3d.runs import coordinates, own_part, phase_ops, run_cases
from dpcourse.toys.gpt import GPTConfig, activations
from dpcourse.toys.text import samples
from markers import chapter

matplotlib.use("Agg")
pytestmark = chapter("gpt_in_3d")

TINY = dict(vocab=16, seq=8, d_model=16, n_heads=4, n_layers=2)


def test_the_mesh_layout_is_init_device_meshs():
    got = expected_mesh((2, 2, 2))[5]
    assert got == {"coords": [1, 0, 1], "members": {"dp": [1, 5], "pp": [5, 7], "tp": [4, 5]}}
    assert all(coordinates((1, 2, 4), r) == {"dp": 0, "pp": r // 4, "tp": r % 4} for r in range(8))


def test_a_rank_is_sent_its_own_piece_of_a_block_case_only():
    x, dy = activations((2, 8, 16), 1), activations((2, 8, 16), 2)
    case = dict(kind="block", config=TINY, seed=0, tp=2, replicas=[(x, dy), (x + 1, dy + 1)])
    part = own_part(case, 3)  # replica 1, tp rank 1: the second half of the sequence of replica 1
    assert "replicas" not in part
    assert torch.equal(part["x"], (x + 1)[:, 4:]) and torch.equal(part["dy"], (dy + 1)[:, 4:])


def test_pipeline_ranks_get_inputs_on_the_first_stage_and_targets_on_the_last_of_their_rows_only():
    rows = samples(8, 8)
    case = dict(kind="train", config=TINY, seed=0, layouts=[(2, 2, 2)], steps=[rows], recipe=Recipe(batch=8))
    first, middle_tp, last = own_part(case, 0), own_part(case, 1), own_part(case, 6)
    assert "steps" not in first
    (inputs, targets), = first["batches"][0]
    assert torch.equal(inputs, rows[:4, :-1]) and targets is None            # dp 0, stage 0
    assert torch.equal(middle_tp["batches"][0][0][0], rows[:4, :-1])         # its tp peer: the same rows
    inputs, targets = last["batches"][0][0]                                  # dp 1, stage 1
    assert inputs is None and torch.equal(targets, rows[4:, 1:])


def test_pieces_of_parameters_are_compared_where_they_sit():
    whole = {"w": torch.arange(12.0, dtype=torch.float64).view(4, 3)}
    expect_parameters({"w": [[2, 0], whole["w"][2:].clone()]}, whole, "rank 1")
    with pytest.raises(AssertionError, match=r"w \(its piece at \[2, 0\]\)"):
        expect_parameters({"w": [[2, 0], whole["w"][:2].clone()]}, whole, "rank 1")


def test_bytes_per_group_prices_each_call_as_a_ring():
    ops = [CommOp("all_gather_into_tensor", None, 100, 0, 0, (0, 1)), CommOp("send", 1, 64, 0, 0, (0, 2)),
           CommOp("reduce_scatter_tensor", None, 400, 0, 0, (0, 1, 2, 3))]
    report = {"ops": ops, "phases": [["step 0", 0, 0.0], ["end", None, 1.0]]}
    assert phase_ops(report, "step 0") == ops
    assert bytes_per_group(report, ["step 0"]) == {(0, 1): 100.0, (0, 2): 64.0, (0, 1, 2, 3): 300.0}


def make_mesh(dp, pp, tp):
    from torch.distributed.device_mesh import init_device_mesh

    if dp * pp * tp != dist.get_world_size():
        raise ValueError(f"{dp * pp * tp} != {dist.get_world_size()}")
    return init_device_mesh("cpu", (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))


def test_a_mesh_case_runs_on_ranks_and_reports_every_group():
    reports = run_cases("mesh", {"make_mesh": make_mesh}, 4, [dict(layout=(2, 1, 2))],
                        exercise="make_mesh")[0]
    expect_mesh(reports, (2, 1, 2), "make_mesh(2, 1, 2)")
    assert reports[3]["members"] == {"dp": [1, 3], "pp": [3], "tp": [2, 3]}


def test_the_planner_counts_what_the_layouts_split():
    model, machine = GPTConfig().as_dict(), cluster(nodes=1)
    dp8 = predict(model, (8, 1, 1), batch=16, n_micro=1, machine=machine)
    tp8 = predict(model, (1, 1, 8), batch=16, n_micro=1, machine=machine)
    pp2 = predict(model, (4, 2, 1), batch=16, n_micro=4, machine=machine)
    assert dp8["parts"]["tp"] == 0 and tp8["parts"]["dp"] == 0 and dp8["parts"]["bubble"] == 0
    assert pp2["parts"]["bubble"] == pytest.approx(pp2["parts"]["compute"] * 1 / 4)
    assert tp8["memory_parts"]["activations"] < dp8["memory_parts"]["activations"] * 8  # split by tp
    seven_b = dict(vocab=32000, seq=4096, d_model=4096, n_heads=32, n_layers=32)
    big = cluster(nodes=8)
    assert predict(seven_b, (64, 1, 1), batch=512, n_micro=1, machine=big)["memory"] > big["memory"]
    fits = predict(seven_b, (4, 2, 8), batch=512, n_micro=16, machine=big)
    assert fits["memory"] < big["memory"] and fits["parts"]["pp"] > 0


def test_the_pictures_draw_from_reports():
    from dpcourse.topics.gpt_in_3d.pictures import draw_losses, draw_mesh, draw_step

    ops = [CommOp("all_gather_into_tensor", None, 100, 0.0, 0.001, (0, 1)),
           CommOp("send", 1, 64, 0.001, 0.002, (0, 2))]
    reports = [{"ops": ops, "phases": [["step 1", 0, 0.0], ["end", None, 1.0]]} for _ in range(8)]
    draw_mesh((2, 2, 2), reports, ["step 1"])
    draw_step(reports, (2, 2, 2), "step 1")
    draw_losses({"(2, 2, 2)": [2.0, 1.9]}, [2.0, 1.9])
    matplotlib.pyplot.close("all")


def test_batches_of_a_recipe_are_its_global_batches():
    recipe = Recipe(batch=4, data_seed=3)
    assert [b.shape for b in batches_of(samples(8, 8), recipe, 3)] == [(4, 9)] * 3
