"""dpcourse.topics.hybrid.costs (the cost model, written out by hand for one layout), the planner's
checks in `checks`, the traffic formulas against parameter counts, and the pictures (they draw)."""

import matplotlib
import pytest

matplotlib.use("Agg")

from dpcourse import launch  # noqa: E402
from dpcourse.topics.hybrid import costs  # noqa: E402
from dpcourse.topics.hybrid.checks import (  # noqa: E402
    expect_plan,
    expect_plan_refused,
    expected_grid,
    smallest_memory,
)
from dpcourse.topics.hybrid.grid import mesh_grid  # noqa: E402
from dpcourse.topics.hybrid.models import dp_tp_model, placement, tensor_parallel_copy  # noqa: E402
from dpcourse.topics.hybrid.pictures import draw_grid, plot_strategies, strategies  # noqa: E402
from dpcourse.topics.hybrid.traffic import dp_pp_bytes, dp_tp_bytes, local_parameters  # noqa: E402
from dpcourse.toys import clusters  # noqa: E402
from dpgrader.hybrid_parallelism.checks import best_layout  # noqa: E402
from markers import exercise  # noqa: E402

MODEL = dict(params=1.2e9, layers=8, hidden=2048, heads=16, seq=1024, batch=32)


@exercise("plan")
def test_predict_by_hand_for_dp2_tp4_pp1():
    cl = clusters.cluster(nodes=2, gpus_per_node=4)
    p = costs.predict(MODEL, cl, dp=2, tp=4, pp=1, micro=2)
    b, e = 8, 2
    compute = 6 * 1.2e9 * b * 1024 / (4 * 140e12)
    activation = b * 1024 * 2048 * e
    tp = 8 * 4 * 2 * 3 * (5e-6 + activation / (4 * 300e9))          # NVLink: 4 divides 4 GPUs per node
    dp = 2 * 1 * (10e-6 + e * 1.2e9 / 4 / (2 * 25e9))                # the dp group crosses the network
    assert p["time"] == pytest.approx(2 * (compute + tp) + dp, rel=1e-12)
    state = 16 * 1.2e9 / 4
    layer = 1024 * b * 2048 * (10 + 24 / 4 + 5 * 16 * 1024 / (2048 * 4))
    assert p["memory"] == pytest.approx(state + 8 * 1 * layer, rel=1e-12)
    assert p["bubble"] == 0 and p["pp_comm"] == 0


@exercise("plan")
def test_pipeline_bubble_links_recompute_zero_and_overlap():
    cl = clusters.cluster(nodes=2, gpus_per_node=4)
    p = costs.predict(MODEL, cl, dp=1, tp=2, pp=4, micro=32)
    per_micro = (p["compute"] + p["tp_comm"] + p["pp_comm"]) / 32
    assert p["bubble"] == pytest.approx(3 * per_micro)
    assert clusters.link(cl, 8) == (cl["inter_latency"], cl["inter_bandwidth"])   # tp x pp = 8 spans 2 nodes
    recompute = costs.predict(dict(MODEL, recompute=True), cl, dp=1, tp=2, pp=4, micro=32)
    assert recompute["compute"] == pytest.approx(p["compute"] * 8 / 6)
    assert recompute["activations"] < p["activations"]
    zero = costs.predict(MODEL, cl, dp=8, tp=1, pp=1, micro=4, zero=3)
    plain = costs.predict(MODEL, cl, dp=8, tp=1, pp=1, micro=4)
    assert zero["dp_comm"] == pytest.approx(1.5 * plain["dp_comm"])
    assert zero["state"] == pytest.approx(plain["state"] / 8)
    overlapped = costs.predict(MODEL, cl, dp=8, tp=1, pp=1, micro=4, overlap=True)
    assert overlapped["dp_comm"] == pytest.approx(max(0.0, plain["dp_comm"] - 2 / 3 * plain["compute"] / 4))


@exercise("plan")
@pytest.mark.parametrize("layout, message", [((3, 1, 1, 1), "GPUs"), ((1, 1, 8, 1), "layers"),
                                             ((8, 1, 1, 3), "micro-batches")])
def test_bad_layouts_are_refused(layout, message):
    cl = clusters.cluster(nodes=2, gpus_per_node=4)
    with pytest.raises(ValueError, match=message):
        costs.predict(dict(MODEL, layers=6), cl, *layout)


@exercise("plan")
def test_plan_checks_accept_the_best_and_name_what_is_wrong():
    cl = clusters.cluster(nodes=2, gpus_per_node=4, memory=6e9)
    best, least = best_layout(MODEL, cl)
    assert best == dict(dp=1, tp=2, pp=4, micro=32)
    good = dict(best, **{k: costs.predict(MODEL, cl, **best)[k] for k in ("time", "memory")})
    expect_plan({"result": good}, MODEL, cl, best, "plan")
    slower = dict(dp=1, tp=2, pp=4, micro=16)
    slow = dict(slower, **{k: costs.predict(MODEL, cl, **slower)[k] for k in ("time", "memory")})
    with pytest.raises(AssertionError, match="try every dp, tp, pp"):
        expect_plan({"result": slow}, MODEL, cl, best, "plan")
    big = dict(dp=2, tp=4, pp=1, micro=1)
    too_big = dict(big, **{k: costs.predict(MODEL, cl, **big)[k] for k in ("time", "memory")})
    with pytest.raises(AssertionError, match="more than the 6 GB"):
        expect_plan({"result": too_big}, MODEL, cl, best, "plan")
    refused = {"error": "ValueError", "message": "no layout fits"}
    with pytest.raises(AssertionError, match=r"but \{'dp': 1, 'tp': 2, 'pp': 4, 'micro': 32\} fits \(3.10"):
        expect_plan(refused, MODEL, cl, best, "plan")
    tiny = clusters.cluster(nodes=2, gpus_per_node=4, memory=2e9)
    assert best_layout(MODEL, tiny)[0] is None and smallest_memory(MODEL, tiny) == pytest.approx(least)
    named = {"error": "ValueError", "message": f"needs at least {least / 1e9:.1f} GB"}
    expect_plan_refused(named, MODEL, tiny, "plan")
    with pytest.raises(AssertionError, match="smallest memory per GPU"):
        expect_plan_refused({"error": "ValueError", "message": "does not fit"}, MODEL, tiny, "plan")


@exercise("hybrid_dp_tp_step", "hybrid_dp_pp_step")
def test_traffic_formulas_count_the_parameters_a_rank_holds():
    for blocks, bias, tp in ((1, True, 2), (2, False, 4)):
        full = dp_tp_model(blocks=blocks, bias=bias)
        held = sum(p.numel() // (1 if placement(n) == "replicated" else tp)
                   for n, p in full.named_parameters())
        assert local_parameters(6, 8, 16, 3, blocks, tp, bias) == held
    assert dp_tp_bytes(dict(blocks=2), 8, 2, 2) == {"tp": 1024, "dp": 2968}
    assert dp_pp_bytes(6, 84, 8, 2, 2, 2, stage=0) == {"pp": 2 * 2 * 6 * 8, "dp": 84 * 8}
    assert dp_pp_bytes(6, 84, 8, 1, 3, 2, stage=1)["pp"] == 2 * 2 * 4 * 6 * 8


@exercise("hybrid_dp_tp_step")
def test_tensor_parallel_copy_keeps_the_full_model_s_names():
    def names():
        _, mesh = mesh_grid(2, tp=2)
        model = tensor_parallel_copy(dp_tp_model(blocks=1), mesh["tp"])
        return {n: tuple(p.shape) for n, p in model.named_parameters()}

    shapes = launch(names, 4)[1]
    assert shapes == {"0.weight": (8, 6), "0.bias": (8,), "1.block.fc1.weight": (8, 8),
                      "1.block.fc1.bias": (8,), "1.block.fc2.weight": (8, 8), "1.block.fc2.bias": (8,),
                      "2.weight": (3, 8), "2.bias": (3,)}


@exercise("make_grid_groups", "plan")
def test_pictures_draw():
    reports = [{"sizes": {"dp": 2, "pp": 1, "tp": 2}, "coords": c["coords"], "members": c["members"]}
               for c in expected_grid(2, 2)]
    assert len(draw_grid(reports).axes) == 3
    cl = clusters.cluster()
    rows = strategies(costs.GPT_7B, cl, plan=lambda m, c: dict(dp=32, tp=8, pp=1, micro=1))
    assert set(rows) == {"DP", "ZeRO-3", "TP", "PP", "hybrid (your plan)"}
    assert rows["DP"]["memory"] > cl["memory"] and rows["hybrid (your plan)"]["memory"] < cl["memory"]
    plot_strategies(rows, cl)


def test_tp_must_divide_the_hidden_size_and_the_heads():
    model = dict(params=2e8, layers=4, hidden=1024, heads=16, seq=512, batch=12)
    six = clusters.cluster(nodes=1, gpus_per_node=6)
    with pytest.raises(ValueError, match="a hidden size of 1024 does not split evenly over tp 3"):
        costs.predict(model, six, 2, 3, 1, 1)
    with pytest.raises(ValueError, match="12 attention heads do not split evenly over tp 8"):
        costs.predict(dict(model, heads=12), clusters.cluster(nodes=1), 1, 8, 1, 1)
    assert costs.tp_splits(dict(model, heads=0), 2) is None  # no attention: the hidden size alone
    assert {tp for _, tp, _, _ in costs.layouts(model, six)} == {1, 2}
    best = costs.fastest(model, six)
    assert (best["dp"], best["tp"], best["pp"], best["micro"]) == (3, 2, 1, 1)


def test_the_widget_adds_the_fastest_layout_with_overlap():
    cl = clusters.cluster()
    rows = strategies(costs.BERT_LARGE, cl, plan=lambda m, c: dict(dp=32, tp=1, pp=8, micro=128),
                      overlap=True)
    fastest = rows["fastest with overlap (every layout)"]
    assert (fastest["dp"], fastest["tp"], fastest["pp"]) == (256, 1, 1)
    assert fastest["time"] < rows["hybrid (your plan)"]["time"]
    assert "fastest with overlap (every layout)" not in strategies(costs.BERT_LARGE, cl)
    assert "do not split evenly over tp 256" in strategies(costs.BERT_LARGE, cl)["TP"]  # 16 heads
