"""Hidden checks of 10_zero_and_fsdp. Each raises a short AssertionError saying what is wrong.

The runs (dpcourse.topics.zero.runs) train the learner's class inside the ranks and return
plain results; the verdicts (dpcourse.topics.zero.checks) compare them, in this process,
with one process trained on the same global batches in float64, with the shard rule
chunk_bounds, the ring byte counts of the recorder's calls and the FlatUnit log. The
cases add what the visible tests leave out: 1 and 4 ranks, parameter counts N does not
divide (147 = 37+37+37+36 on 4 ranks, 306 on 4), frozen parameters, the explicit gradient
shard of ZeRO-2's step, and MiniFSDP on two process groups of 2 ranks each.
"""

from dpcourse import LaunchError, launch
from dpcourse.runtime.timeouts import TIMEOUTS
from dpcourse.topics.zero.checks import expect_fsdp, expect_zero1, expect_zero2
from dpcourse.topics.zero.runs import fsdp_run, model_label, zero1_run, zero2_run

GROUP_TIMEOUT = TIMEOUTS["test_group"]
NARROW = ("deep_mlp", {"width": 5})  # 147 parameters: uneven shards on 2 and 4 ranks


def _cases(run, learner, cases):
    """Inside a rank: run(learner, *case) for each case, in order (one launch for several cases)."""
    return [run(learner, *case) for case in cases]


def _launch_cases(run, learner, world_size, cases, what):
    try:
        per_rank = launch(_cases, world_size, run, learner, cases, group_timeout=GROUP_TIMEOUT)
    except LaunchError as error:
        first = str(error).splitlines()[0]
        hint = ""
        if "SIGSEGV" in str(error):
            hint = (" -- a segmentation fault: a unit's parameters were read while freed. Gather a unit "
                    "(unit.alloc() and the all-gather) before its forward and again before its backward")
        raise AssertionError(f"{what} on {world_size} rank(s) failed: {first}{hint}") from None
    return [[rank_results[i] for rank_results in per_rank] for i in range(len(cases))]


# --------------------------------------------------------------------------- 1. ShardedOptimizer

def check_sharded_optimizer(ShardedOptimizer):
    plan = {4: [(NARROW, 5, 3, 2, False), ("frozen_first_layer", 6, 2, 2, True)],
            1: [("deep_mlp", 7, 2, 4, False)]}
    for world_size, cases in plan.items():
        for case, results in zip(cases, _launch_cases(zero1_run, ShardedOptimizer, world_size, cases,
                                                      "ShardedOptimizer"), strict=True):
            model, seed, steps, per_rank, explicit = case
            how = ", step(gradient_shard)" if explicit else ""
            expect_zero1(results, model, seed, steps, per_rank,
                         what=f"ShardedOptimizer ({model_label(model)}, {world_size} ranks{how})")


# --------------------------------------------------------------------------- 2. reduce_scatter_gradients

def check_reduce_scatter_gradients(reduce_scatter_gradients):
    plan = {4: [("frozen_first_layer", 8, 2, 2)], 2: [(NARROW, 9, 2, 3)], 1: [("deep_mlp", 10, 2, 4)]}
    for world_size, cases in plan.items():
        for case, results in zip(cases, _launch_cases(zero2_run, reduce_scatter_gradients, world_size, cases,
                                                      "reduce_scatter_gradients"), strict=True):
            model, seed, steps, per_rank = case
            expect_zero2(results, model, seed, steps, per_rank,
                         what=f"reduce_scatter_gradients ({model_label(model)}, {world_size} ranks)")


# --------------------------------------------------------------------------- 3. MiniFSDP

def check_mini_fsdp(MiniFSDP):
    plan = {4: [("deep_mlp", 11, 2, 2, None), ("deep_mlp", 12, 2, 2, [[0, 1], [2, 3]])],
            2: [("frozen_first_layer", 13, 2, 2, None)], 1: [(NARROW, 14, 2, 4, None)]}
    for world_size, cases in plan.items():
        for case, results in zip(cases, _launch_cases(fsdp_run, MiniFSDP, world_size, cases, "MiniFSDP"),
                                 strict=True):
            model, seed, steps, per_rank, groups = case
            how = f", groups {groups}" if groups else ""
            expect_fsdp(results, model, seed, steps, per_rank,
                        what=f"MiniFSDP ({model_label(model)}, {world_size} ranks{how})")

