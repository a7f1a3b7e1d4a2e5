"""What sequence and context parallelism must reproduce: a transformer MLP block and plain attention.

    block = mlp_block(d_model=8, d_hidden=32, seed=0)   # x + fc2(GELU(fc1(LayerNorm(x)))), float64
    out = attention(q, k, v, causal=True)                # softmax(q kᵀ / √d + mask) v, one process
    positions = contiguous_positions(10, 4)              # [tensor([0, 1, 2]), tensor([3, 4, 5]), ...]

Why a module: each exercise of notebook 12 is right when it computes exactly what one process
computes on the whole sequence, so every rank and every test cell rebuilds the *same* block from
a seed (float64, torch's default initialisation, the global generator untouched), and the
attention reference is the textbook formula written out in float64, independent of any
blockwise trick.

Layouts: the MLP block takes activations as (seq, batch, d_model), sequence first like
Megatron-LM, so that a rank's part of the sequence is a contiguous slice of dim 0 (what
`dist.all_gather_single` and `dist.reduce_scatter_single` concatenate and split). Attention
takes q, k, v as (batch, heads, seq, d_head), like `F.scaled_dot_product_attention`.

A sequence split is a list of position tensors, one per rank: `positions[r]` holds the global
sequence positions of rank r's tokens, ascending. The causal mask is defined on positions (a
query at position i sees the keys at positions <= i), so the same code serves the contiguous
split and the load-balanced one of notebook 12.
"""

import math

import torch
from torch import nn

from dpcourse.backend import rank_device
from dpcourse.reference.splits import chunk_bounds


class MLPBlock(nn.Module):
    """A transformer layer's MLP half: x + fc2(GELU(fc1(LayerNorm(x)))), x of shape (seq, batch, d_model)."""

    def __init__(self, d_model, d_hidden, bias=True):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, d_hidden, bias=bias)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(d_hidden, d_model, bias=bias)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


def mlp_block(d_model=8, d_hidden=32, bias=True, seed=0, dtype=torch.float64, device=None):
    """The unsharded block, initialised from `seed` (LayerNorm's weight and bias drawn too, so that a
    slice taken from the wrong place cannot pass for the right one)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        block = MLPBlock(d_model, d_hidden, bias)
        with torch.no_grad():
            block.norm.weight.uniform_(0.5, 1.5)
            block.norm.bias.uniform_(-0.5, 0.5)
    return block.to(dtype=dtype, device=device if device is not None else rank_device())


def inputs(shape, seed, dtype=torch.float64, scale=1.0):
    """A reproducible standard-normal tensor (times `scale`), on the CPU: the same in every rank and cell."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype) * scale


def contiguous_positions(seq_len, world_size):
    """Rank r holds the r-th of `world_size` contiguous pieces (torch.tensor_split's sizes)."""
    return [torch.arange(start, stop) for start, stop in chunk_bounds(seq_len, world_size)]


def head_tail_positions(seq_len, world_size):
    """The load-balanced split, written out: 2N pieces (tensor_split's sizes); rank r holds pieces r
    and 2N - 1 - r, ascending (torch's `_HeadTailLoadBalancer`)."""
    pieces = [torch.arange(a, b) for a, b in chunk_bounds(seq_len, 2 * world_size)]
    return [torch.cat((pieces[r], pieces[2 * world_size - 1 - r])) for r in range(world_size)]


def attention(q, k, v, q_positions=None, k_positions=None, causal=False):
    """softmax(q kᵀ / √d_head + mask) v in float64; q, k, v (..., seq, d_head).

    With causal=True a query at position i sees the keys at positions <= i; positions default to
    0, 1, ... A query that sees no key at all gets zeros (never happens in a whole sequence).
    """
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        qp = torch.arange(q.shape[-2]) if q_positions is None else q_positions
        kp = torch.arange(k.shape[-2]) if k_positions is None else k_positions
        hidden = kp.view(1, -1) > qp.view(-1, 1)
        scores = scores.masked_fill(hidden, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return weights @ v


def rows_of(tensor, positions, dim=-2):
    """The rows of `tensor` (along `dim`) at the given positions: what one rank holds of a sequence."""
    return tensor.index_select(dim, positions)


def visible_pairs(q_positions, k_positions, causal):
    """How many (query, key) pairs of a block have to be computed: all of them, or causal ones only."""
    if not causal:
        return len(q_positions) * len(k_positions)
    return int((k_positions.view(1, -1) <= q_positions.view(-1, 1)).sum())
