"""dpcourse.topics.hybrid.realapi: torch's parallelize_module + fully_shard on a (dp, tp) mesh trains like
one process, with its collectives on the right groups; the side-by-side table reports both errors."""

import re

import pytest

from dpcourse.runtime.launcher import launch
from dpcourse.topics.hybrid.checks import reference_training
from dpcourse.topics.hybrid.models import dp_tp_model
from dpcourse.topics.hybrid.realapi import print_side_by_side, torch_dp_tp_training
from dpcourse.topics.tensor.models import inputs
from dpgrader.hybrid_parallelism.tuned import dp_tp_step
from markers import exercise

pytestmark = exercise("hybrid_dp_tp_step")

CASE = dict(grid=(2, 2), model=dict(blocks=2, seed=1), lr=0.2,
            batches=[(inputs((8, 6), seed=20 + s), inputs((8, 3), seed=30 + s)) for s in range(2)])


def test_torch_s_hybrid_step_trains_like_one_process_on_the_right_groups():
    rows = launch(torch_dp_tp_training, 4, CASE)
    one = reference_training(dp_tp_model(**CASE["model"]), CASE["batches"], CASE["lr"], 2)
    for row in rows:
        replica = row["rank"] // 2
        assert row["losses"] == pytest.approx([losses[replica] for losses in one["losses"]], abs=1e-12)
        for name, want in one["params"][-1].items():
            assert (row["params"][name] - want).abs().max() < 1e-12, name
    tp_group, dp_group = [0, 1], [0, 2]
    calls = rows[0]["calls"][0]
    assert ["all_reduce", tp_group] in calls and ["reduce_scatter_tensor", dp_group] in calls
    assert all(group in (tp_group, dp_group) for _, group in calls)


def test_side_by_side_reports_both_errors(capsys):
    print_side_by_side(CASE, dp_tp_step)
    errors = [float(e) for e in re.findall(r"\s(\d\.\de-\d+)\n", capsys.readouterr().out)]
    assert len(errors) == 2 and max(errors) < 1e-12
