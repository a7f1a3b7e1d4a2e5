"""Hidden checks of 10_zero_and_fsdp. Each raises a short AssertionError saying what is wrong.

The runs (dpcourse.topics.zero.runs) train the learner's class inside the ranks and return
plain results; the verdicts (dpcourse.topics.zero.checks) compare them, in this process,
with one process trained on the same global batches in float64, with the shard rule
chunk_bounds, the ring byte counts of the calls on the wire (the grader's router when
grading) and the FlatUnit log. The cases add what the visible tests leave out: 1 and 4
ranks, parameter counts N does not divide (147 = 37+37+37+36 on 4 ranks, 306 =
77+77+76+76), frozen parameters, the explicit gradient shard of ZeRO-2's step, and MiniFSDP
on two process groups of 2 ranks each and with two backward passes per step (accumulation). One
launch per case: the traffic of a launch is
judged whole.
"""

from dpcourse.topics.zero.checks import expect_fsdp, expect_zero1, expect_zero2
from dpcourse.topics.zero.measured import expect_zero1_memory, expect_zero2_memory, expect_zero3_memory
from dpcourse.topics.zero.runs import fsdp_run, launch_run, model_label, zero1_run, zero2_run

# What each exercise's expected values come from (autograder/exercises.json lists them).
REFERENCES = {
    "sharded_optimizer": "one process trained in float64 on the same global batches; shards by chunk_bounds; "
                         "the ring bytes of an all-gather",
    "reduce_scatter_gradients": "one process trained in float64 on the same global batches; shards by "
                                "chunk_bounds; the ring bytes of a reduce-scatter",
    "mini_fsdp": "one process trained in float64 on the same global batches; the FlatUnit log (at most two "
                 "units unsharded); the ring bytes of all-gathers and reduce-scatters",
}

NARROW = ("deep_mlp", {"width": 5})  # 147 parameters: uneven shards on 2 and 4 ranks


def check_sharded_optimizer(ShardedOptimizer):
    for world_size, model, seed, steps, per_rank, explicit in [(4, NARROW, 5, 3, 2, True),
                                                               (4, "frozen_first_layer", 6, 2, 2, False),
                                                               (1, "deep_mlp", 7, 2, 4, False)]:
        results = launch_run(zero1_run, world_size, ShardedOptimizer, model, seed, steps, per_rank, explicit)
        how = ", step(gradient_shard)" if explicit else ""
        expect_zero1(results, model, seed, steps, per_rank,
                     what=f"ShardedOptimizer ({model_label(model)}, {world_size} ranks{how})")
    expect_zero1_memory(ShardedOptimizer)  # graded: 1/N measured from outside the learner's objects


def check_reduce_scatter_gradients(reduce_scatter_gradients):
    for world_size, model, seed, steps, per_rank in [(4, "frozen_first_layer", 8, 2, 2), (2, NARROW, 9, 2, 3),
                                                     (1, "deep_mlp", 10, 2, 4)]:
        results = launch_run(zero2_run, world_size, reduce_scatter_gradients, model, seed, steps, per_rank)
        expect_zero2(results, model, seed, steps, per_rank,
                     what=f"reduce_scatter_gradients ({model_label(model)}, {world_size} ranks)")
    expect_zero2_memory(reduce_scatter_gradients)


def check_mini_fsdp(MiniFSDP):
    for world_size, model, seed, steps, per_rank, groups, accumulate in [
            (4, "deep_mlp", 11, 2, 2, None, 1), (4, "deep_mlp", 12, 2, 2, [[0, 1], [2, 3]], 1),
            (2, "frozen_first_layer", 13, 2, 2, None, 2), (1, NARROW, 14, 2, 4, None, 1)]:
        results = launch_run(fsdp_run, world_size, MiniFSDP, model, seed, steps, per_rank, groups,
                             accumulate=accumulate)
        how = (f", groups {groups}" if groups else "") + (f", {accumulate} backward passes per step"
                                                         if accumulate > 1 else "")
        expect_fsdp(results, model, seed, steps, per_rank,
                    what=f"MiniFSDP ({model_label(model)}, {world_size} ranks{how})")
    expect_zero3_memory(MiniFSDP)
