"""dpcourse.topics.sequence.models: the references of notebook 12 against torch's own functions."""

import torch
import torch.nn.functional as F

from dpcourse.topics.sequence.models import (
    attention,
    contiguous_positions,
    head_tail_positions,
    inputs,
    mlp_block,
    visible_pairs,
)
from markers import exercise

pytestmark = exercise("ring_attention", "balanced_positions", "sequence_parallel_mlp")


def test_attention_is_torchs_scaled_dot_product_attention_in_float64():
    q, k, v = (inputs((2, 3, 7, 4), seed) for seed in (1, 2, 3))
    for causal in (False, True):
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        assert torch.allclose(attention(q, k, v, causal=causal), expected, atol=1e-12)


def test_the_causal_mask_is_on_positions_not_on_row_indices():
    q, k, v = (inputs((1, 1, 6, 2), seed) for seed in (4, 5, 6))
    full = attention(q, k, v, causal=True)
    rows = torch.tensor([1, 4, 5])
    some = attention(q[..., rows, :], k, v, rows, torch.arange(6), causal=True)
    assert torch.allclose(some, full[..., rows, :])


def test_the_two_splits_are_torchs_tensor_split_and_the_head_tail_balancer():
    for seq, n in [(10, 4), (16, 4), (7, 2), (5, 1)]:
        assert [p.tolist() for p in contiguous_positions(seq, n)] == \
            [p.tolist() for p in torch.arange(seq).tensor_split(n)]
    assert [p.tolist() for p in head_tail_positions(8, 2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    pieces = torch.arange(10).tensor_split(6)
    assert head_tail_positions(10, 3)[0].tolist() == torch.cat((pieces[0], pieces[5])).tolist()


def test_the_head_tail_split_balances_the_causal_pairs_and_the_contiguous_one_does_not():
    def spread(positions):
        pairs = [visible_pairs(p, torch.arange(64), causal=True) for p in positions]
        return max(pairs) / (sum(pairs) / len(pairs))

    assert spread(head_tail_positions(64, 4)) == 1.0
    assert spread(contiguous_positions(64, 4)) > 1.5


def test_the_block_is_seeded_float64_and_leaves_the_global_generator_alone():
    state = torch.random.get_rng_state()
    a, b = mlp_block(8, 16, seed=3, device="cpu"), mlp_block(8, 16, seed=3, device="cpu")
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(p, q) and p.dtype == torch.float64 for p, q in zip(a.parameters(), b.parameters(),
                                                                              strict=True))
    x = inputs((5, 2, 8), seed=1)
    assert torch.allclose(a(x), x + a.fc2(a.act(a.fc1(a.norm(x)))))
    assert not torch.equal(a.norm.weight, torch.ones(8))  # a LayerNorm slice from the wrong place shows
