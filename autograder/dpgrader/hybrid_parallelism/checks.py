"""Hidden checks of 09_hybrid_parallelism. Each raises a short AssertionError saying what is wrong.

Yardsticks, all independent of the learner's code:
  * make_grid_groups: init_device_mesh's layout, torch.arange(world).view(dp, pp, tp), with each
    axis' groups cut as DeviceMesh cuts them (dpcourse.topics.hybrid.checks), and the members of
    every group each rank created, in order, recorded around dist.new_group in the ranks;
  * the two hybrid steps: one float64 process training the unsharded model on the same global
    batches (checks.reference_training), and the bytes per group of dpcourse.topics.hybrid.traffic;
    each case's grid and model are built in the ranks with init_device_mesh and the course's
    layers, never with the learner's grid;
  * plan: every layout tried here (`best_layout`), with the released cost model.
Hidden cases: grids of 1 x 4, 4 x 1 and 2 x 2 (and 3-D grids on 4 and 8 ranks for the groups, and grids
larger and smaller than the world),
several steps in float64, 1 to 3 blocks with and without biases, 1 to 4 pipeline stages with a
stage of no parameters and m from 1 to 4, and small clusters where the best layout is hybrid,
pure, or where nothing fits.
"""

import random

from dpcourse.topics.hybrid.checks import (
    expect_bad_sizes_refused,
    expect_dp_pp,
    expect_dp_tp,
    expect_grid,
    expect_plan,
    expect_plan_refused,
)
from dpcourse.topics.hybrid.costs import layouts, predict
from dpcourse.topics.hybrid.runs import run_dp_pp_cases, run_dp_tp_cases, run_grid_cases, run_plan_cases
from dpcourse.topics.tensor.models import inputs
from dpcourse.toys.clusters import cluster

REFERENCES = {
    "make_grid_groups": "init_device_mesh's layout (torch.arange(world).view(dp, pp, tp), each axis cut as "
                        "DeviceMesh cuts it) and the members of every group each rank created, in order",
    "hybrid_dp_tp_step": "the unsharded float64 model trained in one process on the same global batches, "
                         "and the bytes per group of dpcourse.topics.hybrid.traffic",
    "hybrid_dp_pp_step": "the unsharded float64 model trained in one process on the same global batches, "
                         "and the bytes per group of dpcourse.topics.hybrid.traffic",
    "plan": "brute force: every (dp, tp, pp, micro-batch) layout tried with the released cost model "
            "(best_layout below)",
}

# --------------------------------------------------------------------------- 1. grids

GRIDS = {4: [dict(dp=2, tp=2), dict(dp=1, tp=4), dict(dp=4, tp=1), dict(dp=1, tp=2, pp=2),
              dict(dp=2, tp=1, pp=2)],
         8: [dict(dp=2, tp=2, pp=2), dict(dp=1, tp=4, pp=2), dict(dp=4, tp=2, pp=1)]}
BAD = {4: [dict(dp=2, tp=3), dict(dp=1, tp=1, pp=2)],   # larger and smaller than the world
       8: [dict(dp=3, tp=3), dict(dp=2, tp=2)]}


def _shape(case):
    return f"make_grid_groups({case['dp']}, {case['tp']}, pp={case.get('pp', 1)})"


def check_make_grid_groups(make_grid_groups):
    for world, cases in GRIDS.items():
        reports = run_grid_cases(make_grid_groups, world, cases + BAD[world])
        for case, case_reports in zip(cases, reports, strict=False):
            expect_grid(case_reports, case, f"{_shape(case)} on {world} ranks")
        for case, case_reports in zip(BAD[world], reports[len(cases):], strict=True):
            expect_bad_sizes_refused(case_reports, f"{_shape(case)} on {world} ranks", case)


# --------------------------------------------------------------------------- 2. data x tensor


def _batches(rows, d_in, d_out, steps, seed):
    return [(inputs((rows, d_in), seed=seed + s), inputs((rows, d_out), seed=seed + 50 + s))
            for s in range(steps)]


DP_TP = [dict(grid=(1, 4), model=dict(blocks=1, seed=11), lr=0.2, batches=_batches(4, 6, 3, 3, 100)),
         dict(grid=(4, 1), model=dict(blocks=2, seed=12), lr=0.2, batches=_batches(8, 6, 3, 3, 200)),
         dict(grid=(2, 2), model=dict(blocks=3, bias=False, d_hidden=8, seed=13), lr=0.3,
              batches=_batches(6, 6, 3, 4, 300))]


def check_hybrid_dp_tp_step(hybrid_dp_tp_step):
    runs = run_dp_tp_cases(hybrid_dp_tp_step, DP_TP)
    for case, case_runs in zip(DP_TP, runs, strict=True):
        dp, tp = case["grid"]
        blocks, steps = case["model"]["blocks"], len(case["batches"])
        what = f"hybrid_dp_tp_step on {dp} x {tp} (dp x tp), {blocks} block(s), {steps} steps"
        expect_dp_tp(case_runs, case, what)


# --------------------------------------------------------------------------- 3. data x pipeline

DP_PP = [dict(grid=(1, 4), model=dict(width=5, layers=4, seed=21), cuts=[0, 2, 3, 4, 7], n_micro=4, lr=0.2,
              batches=_batches(4, 5, 5, 3, 400)),
         dict(grid=(4, 1), model=dict(width=5, layers=3, seed=22), cuts=[0, 5], n_micro=2, lr=0.2,
              batches=_batches(8, 5, 5, 3, 500)),
         dict(grid=(2, 2), model=dict(width=5, layers=2, seed=23), cuts=[0, 2, 3], n_micro=1, lr=0.3,
              batches=_batches(6, 5, 5, 4, 600))]


def check_hybrid_dp_pp_step(hybrid_dp_pp_step):
    runs = run_dp_pp_cases(hybrid_dp_pp_step, DP_PP)
    for case, case_runs in zip(DP_PP, runs, strict=True):
        dp, pp = case["grid"]
        expect_dp_pp(case_runs, case, f"hybrid_dp_pp_step on {dp} x {pp} (dp x pp), cuts {case['cuts']}, "
                                      f"m = {case['n_micro']}, {len(case['batches'])} steps")


# --------------------------------------------------------------------------- 4. plan


def best_layout(model, cl):
    """(the fastest layout that fits, or None; the smallest memory any layout needs), trying them all."""
    best, least = None, None
    for dp, tp, pp, micro in layouts(model, cl):
        p = predict(model, cl, dp, tp, pp, micro)
        least = p["memory"] if least is None else min(least, p["memory"])
        if p["memory"] <= cl["memory"] and (best is None or p["time"] < best[0]):
            best = (p["time"], dict(dp=dp, tp=tp, pp=pp, micro=micro))
    return (None if best is None else best[1]), least


def _plan_cases():
    rng = random.Random(9)
    cases = []
    while len(cases) < 40:
        model = dict(params=rng.choice([1e8, 3e8, 1.3e9, 4e9, 13e9]), layers=rng.choice([2, 3, 4, 6, 8, 12]),
                     hidden=rng.choice([512, 1024, 2048, 4096]), heads=rng.choice([8, 16]),
                     seq=rng.choice([256, 1024, 2048]), batch=rng.choice([4, 6, 8, 12, 16, 24]),
                     recompute=rng.random() < 0.5)
        cl = cluster(nodes=rng.choice([1, 2, 3]), gpus_per_node=rng.choice([1, 2, 4]),
                     memory=rng.choice([4e9, 16e9, 40e9, 80e9]), inter_bandwidth=rng.choice([3e9, 25e9]),
                     flops=rng.choice([50e12, 140e12]))
        cases.append((model, cl))
    return cases


def check_plan(plan):
    cases = _plan_cases()
    refused = fitted = 0
    for (model, cl), outcome in zip(cases, run_plan_cases(plan, cases), strict=True):
        what = (f"plan({model['params'] / 1e9:g}B parameters, {model['layers']} layers, "
                f"batch {model['batch']}; {cl['nodes']} x {cl['gpus_per_node']} GPUs of "
                f"{cl['memory'] / 1e9:g} GB)")
        best, _ = best_layout(model, cl)
        if best is None:
            refused += 1
            expect_plan_refused(outcome, model, cl, what)
        else:
            fitted += 1
            expect_plan(outcome, model, cl, best, what)
    assert refused and fitted, ("the hidden planner cases must include layouts that fit and clusters "
                                "where none does")
