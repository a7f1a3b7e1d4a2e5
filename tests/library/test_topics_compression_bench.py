"""dpcourse.topics.compression.bench: the hooks race in one launch; torch's is configured like yours."""

import pytest
import torch.distributed as dist

from dpcourse.topics.compression.bench import compare_hooks, torch_state
from markers import exercise

pytestmark = [pytest.mark.usefixtures("no_orphans"), *exercise("powersgd_hook")]


class Stateless:
    def __init__(self, matrix_rank):
        self.matrix_rank = matrix_rank


def averaging_hook(state, bucket):
    world_size = dist.get_world_size()
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(
        lambda fut: fut.value()[0] / world_size)


def test_three_variants_timed_and_compared_with_torch_powersgd():
    medians, ratios = compare_hooks({"averaging": (averaging_hook, Stateless)}, world_size=2, matrix_rank=2,
                                    depth=2, width=32, steps=3, rounds=2)
    assert set(medians) == set(ratios) == {"DDP, no hook", "averaging", "torch powerSGD_hook"}
    assert ratios["torch powerSGD_hook"] == 1.0 and all(m > 0 for m in medians.values())


def test_torch_state_compresses_as_the_exercise_does():
    state = torch_state(4)
    settings = (state.matrix_approximation_rank, state.start_powerSGD_iter, state.min_compression_rate)
    assert settings == (4, 2, 1)
    assert state.use_error_feedback and state.warm_start
