"""The benchmark's ZeRO implementations (autograder/dpgrader/zero_and_fsdp/tuned.py) pass notebook 10's
checks.

They are the instructor's solutions, tuned: if the hidden checks (and the visible ones, on 2 and 3
ranks) accept them, the checks accept an implementation that differs from the notebook's solution
(padded send buffers, broadcasts and reduces instead of all_gather and reduce_scatter on gloo,
weights living in the gathered buffer when N divides S). And the checks themselves can fail: a tuned
class with one mistake planted is refused with the message that names it.
"""

import pytest

from dpcourse.topics.zero.checks import expect_fsdp, expect_zero1
from dpcourse.topics.zero.runs import fsdp_run, launch_run, zero1_run
from dpgrader.zero_and_fsdp.checks import check_mini_fsdp, check_sharded_optimizer
from dpgrader.zero_and_fsdp.tuned import TunedMiniFSDP, TunedShardedOptimizer
from markers import exercise

pytestmark = pytest.mark.usefixtures("no_orphans")


@exercise("sharded_optimizer")
def test_tuned_sharded_optimizer_passes_the_checks():
    for world_size in (2, 3):  # 994 elements: N divides S (weights in the gathered buffer), then not
        results = launch_run(zero1_run, world_size, TunedShardedOptimizer, "deep_mlp", 1, 3, 2)
        expect_zero1(results, "deep_mlp", 1, 3, 2, what="TunedShardedOptimizer")
    check_sharded_optimizer(TunedShardedOptimizer)


@exercise("mini_fsdp")
def test_tuned_mini_fsdp_passes_the_checks():
    results = launch_run(fsdp_run, 3, TunedMiniFSDP, "deep_mlp", 4, 2, 2)
    expect_fsdp(results, "deep_mlp", 4, 2, 2, what="TunedMiniFSDP")
    check_mini_fsdp(TunedMiniFSDP)


class SummingMiniFSDP(TunedMiniFSDP):
    """TunedMiniFSDP that forgets to divide the reduce-scattered gradient by N."""

    def _after_backward(self, unit, shard):
        super()._after_backward(unit, shard)
        shard.grad.mul_(self.world)


class NeverFreedMiniFSDP(TunedMiniFSDP):
    """TunedMiniFSDP whose units stay whole after their forward (and so are never gathered for backward)."""

    def _after_forward(self, unit, send, output):
        pass


@exercise("mini_fsdp")
@pytest.mark.parametrize(("cls", "message"), [(SummingMiniFSDP, "2 times the average"),
                                              (NeverFreedMiniFSDP, "in forward: ZeRO-3 keeps at most 2")])
def test_the_checks_refuse_a_broken_tuned_mini_fsdp(cls, message):
    with pytest.raises(AssertionError, match=message):
        expect_fsdp(launch_run(fsdp_run, 2, cls, "deep_mlp", 0, 2, 2), "deep_mlp", 0, 2, 2)
