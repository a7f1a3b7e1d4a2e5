"""dpcourse.topics.ddp.samplers: a sampler class runs in a separate process and plain lists come back."""

import pytest
from torch.utils.data import DistributedSampler

from dpcourse import LaunchError
from dpcourse.topics.ddp.samplers import run_sampler, run_sampler_cases, sampler_shards
from markers import exercise

pytestmark = exercise("shard_sampler")


class Torch(DistributedSampler):
    """torch's own sampler, called the way a learner's ShardSampler is: (n, num_replicas, rank, ...)."""

    def __init__(self, n, num_replicas, rank, **options):
        super().__init__(range(n), num_replicas=num_replicas, rank=rank, **options)


class LiesAboutItsLength(Torch):
    def __len__(self):
        return 99


class NotWritten:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError()


def test_shards_and_lengths_are_what_each_rank_yields():
    run = sampler_shards(Torch, 10, 4, shuffle=False)
    assert run == {"shards": [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]], "lengths": [3, 3, 3, 3]}
    assert sampler_shards(LiesAboutItsLength, 10, 4)["lengths"] == [99] * 4


def test_one_launch_for_many_cases_and_the_epoch_is_set():
    runs = run_sampler_cases(Torch, [dict(n=12, world_size=3, epoch=e, seed=4) for e in (0, 1)])
    assert runs[0]["shards"] != runs[1]["shards"]
    expected = DistributedSampler(range(12), num_replicas=3, rank=1, seed=4)
    expected.set_epoch(1)
    assert runs[1]["shards"][1] == list(expected)


def test_the_learner_error_names_the_rank():
    with pytest.raises(LaunchError, match="NotImplementedError"):
        run_sampler(NotWritten, 10, 2)
