"""dpcourse.topics.tensor.models, shards and costs: unsharded modules, their slices, traffic formulas."""

import pytest
import torch

from dpcourse.comm.volume import ring_traffic
from dpcourse.reference.shards import column_shard, locate_slices, row_shard, shard_bounds
from dpcourse.topics.tensor.costs import layer_traffic, measured_traffic
from dpcourse.topics.tensor.models import attend, inputs, linear, mlp, self_attention
from markers import chapter, exercise


@chapter("tensor_parallelism")
def test_the_same_seed_builds_the_same_modules_without_touching_the_global_generator():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, b = mlp(8, 16, seed=3), mlp(8, 16, seed=3)
    assert torch.rand(1).equal(before)
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    assert all(p.equal(q) and p.dtype == torch.float64 for p, q in pairs)
    assert not mlp(8, 16, seed=4).fc1.weight.equal(a.fc1.weight)
    assert linear(3, 5, bias=False, seed=0).bias is None
    assert inputs((2, 3), seed=1).equal(inputs((2, 3), seed=1))


@exercise("tensor_parallel_attention")
def test_a_contiguous_slice_of_qkv_features_is_a_set_of_whole_heads():
    attention = self_attention(d_model=8, n_heads=4, seed=0)
    x = inputs((2, 5, 8), seed=1)
    qkv = attention.qkv(x).detach()
    full = attend(qkv, 4)
    halves = [attend(part, 2) for part in qkv.chunk(2, dim=-1)]      # heads 0-1 and 2-3
    assert torch.allclose(torch.cat(halves, dim=-1), full, atol=1e-14)
    assert torch.allclose(attention(x), attention.proj(full), atol=1e-14)
    with pytest.raises(ValueError, match="not n_heads x 3 x d_head"):
        attend(qkv, 5)


@exercise("tensor_parallel_attention")
def test_attention_is_causal():
    attention = self_attention(d_model=8, n_heads=2, seed=0)
    x = inputs((1, 4, 8), seed=2)
    changed = x.clone()
    changed[0, 3] += 1.0                                     # the last token: earlier outputs must not move
    assert torch.allclose(attention(x)[0, :3], attention(changed)[0, :3], atol=1e-14)
    assert not torch.allclose(attention(x)[0, 3], attention(changed)[0, 3])


@exercise("column_parallel_linear", "row_parallel_linear", "tensor_parallel_mlp", "tensor_parallel_attention")
def test_shards_cut_rows_and_columns_and_refuse_uneven_splits():
    weight = torch.arange(24.0).reshape(4, 6)
    assert column_shard(weight, 1, 2).equal(weight[2:4])
    assert row_shard(weight, 2, 3).equal(weight[:, 4:6])
    assert shard_bounds(12, 3, 4) == (9, 12)
    with pytest.raises(ValueError, match="cannot be split evenly over 4 ranks"):
        shard_bounds(6, 0, 4)
    with pytest.raises(ValueError, match="rank 2 is not a rank of a group of 2"):
        shard_bounds(6, 2, 2)


@exercise("column_parallel_linear", "row_parallel_linear", "tensor_parallel_mlp", "tensor_parallel_attention")
def test_locate_slices_finds_where_a_local_piece_comes_from():
    weight = torch.arange(24.0).reshape(4, 6)
    assert locate_slices(weight[2:4], weight, 0) == [2, 3]
    assert locate_slices(weight[:, 1:3], weight, 1) == [1, 2]
    assert locate_slices(weight[2:4] * 2, weight, 0) is None
    assert locate_slices(weight[:0], weight, 0) is None
    assert locate_slices(weight.T[:2], weight, 0) is None


@exercise("tensor_parallel_attention")
def test_traffic_formulas_match_the_notebooks_numbers():
    t = layer_traffic(batch=1, seq=2048, d_model=12288, tp=8, dp=64, element_size=2)  # the written answer
    assert t["tp_all_reduce_bytes"] == 50_331_648
    assert round(t["tp_bytes_sent"] / 1e6) == 352
    assert round(t["dp_all_reduce_bytes"] / 1e6) == 453
    assert round(t["dp_bytes_sent"] / 1e6) == 892
    assert ring_traffic(100, 1)[1] == 0 and ring_traffic(100, 2)[1] == 100


@exercise("tensor_parallel_mlp")
def test_measured_traffic_counts_calls_and_bytes_per_direction():
    from dpcourse.comm.recorder import CommOp

    step = ([CommOp("all_reduce", None, 64, 0.0, 0.0, (0, 1))], [])
    assert measured_traffic(step) == [("forward", "all_reduce", 1, 64), ("backward", "-", 0, 0)]
