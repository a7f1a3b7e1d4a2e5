"""The hidden checks of 05_ddp_from_scratch: their rules match the notebook's worked examples, and the
reference bucketed DDP (used by the benchmark) passes them."""

import pytest

from dpcourse.toys.models import deep_mlp
from dpgrader.ddp_from_scratch.checks import (
    check_bucketed_ddp,
    expected_buckets,
    expected_fusion,
    explain_sampler_shards,
)
from dpgrader.ddp_from_scratch.tuned import ReferenceDDP
from markers import exercise


@exercise("bucketed_ddp", "distributed_optimizer")
def test_bucket_and_fusion_rules_give_the_notebooks_examples():
    model = deep_mlp()
    assert expected_buckets(model, 600) == [2448, 2176, 2176, 1152]
    assert expected_fusion(list(model.parameters()), 2200) == [1152, 2176, 2176, 2176, 272]


@exercise("shard_sampler")
def test_sampler_properties_are_explained():
    explain_sampler_shards([[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]], 10, False, "ok")
    with pytest.raises(AssertionError, match="rank 2 gets 2 indices, expected 3"):
        explain_sampler_shards([[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]], 10, False, "unpadded")
    with pytest.raises(AssertionError, match="every rank gets the same indices"):
        explain_sampler_shards([[0, 4, 8]] * 4, 10, False, "same data")
    with pytest.raises(AssertionError, match=r"samples \[2, 5\] are never used"):
        explain_sampler_shards([[0, 4, 8], [1, 1, 9], [3, 6, 0], [3, 7, 1]], 10, False, "rank seeds")


@exercise("bucketed_ddp")
def test_the_reference_bucketed_ddp_passes_the_hidden_checks():
    check_bucketed_ddp(ReferenceDDP)
