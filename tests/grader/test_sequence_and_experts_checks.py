"""The hidden checks of 12_sequence_and_experts pass the reference implementations (which the benchmark
races), and fail a ring attention that all-gathers K and V instead of passing blocks around the ring."""

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from dpgrader.sequence_and_experts import tuned as reference
from dpgrader.sequence_and_experts.checks import (
    check_balanced_positions,
    check_expert_parallel_moe,
    check_gather_sequence,
    check_reduce_scatter_sequence,
    check_ring_attention,
    check_ring_attention_work,
    check_route_tokens,
    check_sequence_parallel_mlp,
    check_ulysses_attention,
)
from markers import exercise

cloudpickle.register_pickle_by_value(sys.modules[__name__])


@exercise("gather_sequence", "reduce_scatter_sequence", "sequence_parallel_mlp", "ring_attention",
          "balanced_positions", "ulysses_attention", "route_tokens", "expert_parallel_moe")
def test_the_reference_implementations_pass_every_hidden_check():
    check_gather_sequence(reference.gather_sequence)
    check_reduce_scatter_sequence(reference.reduce_scatter_sequence)
    check_sequence_parallel_mlp(reference.SequenceParallelMLP)
    check_ring_attention(reference.ring_attention)
    check_ring_attention_work(reference.ring_attention)
    check_balanced_positions(reference.balanced_positions)
    check_ulysses_attention(reference.ulysses_attention)
    check_route_tokens(reference.route_tokens)
    check_expert_parallel_moe(reference.ExpertParallelMoE)


def gathered_attention(q, k, v, positions, causal=False):
    """Right values, but every K and V all-gathered: not a ring."""
    n = dist.get_world_size()
    size = max(len(p) for p in positions)
    padded = torch.zeros((2, *k.shape[:-2], size, k.shape[-1]), dtype=k.dtype)
    padded[:, ..., :k.shape[-2], :] = torch.stack((k, v))
    pieces = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(pieces, padded)
    keys = torch.cat([piece[..., :len(p), :] for piece, p in zip(pieces, positions, strict=True)], dim=-2)
    return reference.attention_block(q, keys[0], keys[1], positions[dist.get_rank()], torch.cat(positions),
                                     causal)[0]


@exercise("ring_attention")
def test_an_all_gathered_k_and_v_is_refused_as_a_collective():
    with pytest.raises(AssertionError, match="called the collective `all_gather`"):
        check_ring_attention(gathered_attention)
