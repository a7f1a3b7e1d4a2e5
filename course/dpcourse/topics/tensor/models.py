"""The unsharded modules tensor parallelism must reproduce: a Linear, a transformer MLP, self-attention.

    full = mlp(d_model=8, d_hidden=32, seed=0)       # fc1 -> GELU -> fc2, float64
    tp = TensorParallelMLP(full, group)              # notebook 08: each rank keeps its slices of it

Why a module of its own: a tensor-parallel layer is correct when it computes exactly what
the unsharded layer computes, so every rank and every test cell must be able to rebuild the
*same* full weights. Each builder draws torch's default initialisation from a seed, without
touching the global random generator, in float64 (a sum of N partial products then agrees
with the full product to ~1e-16, and a factor N is far outside any tolerance).

The attention's fused `qkv` projection lays its 3·d_model output features out head by head:
[head 0: q, k, v | head 1: q, k, v | ...], each d_head wide (Megatron-LM's layout). A
contiguous slice of those features is then a set of whole heads, so splitting `qkv` like a
column-parallel Linear splits the attention by heads. Used by notebooks 08 and 09.
"""

import math

import torch
from torch import nn

from dpcourse.backend import rank_device


def _seeded(build, seed, dtype, device):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = build()
    return module.to(dtype=dtype, device=device if device is not None else rank_device())


def linear(in_features, out_features, bias=True, seed=0, dtype=torch.float64, device=None):
    """An nn.Linear with torch's default initialisation drawn from `seed` (on this rank's device)."""
    return _seeded(lambda: nn.Linear(in_features, out_features, bias=bias), seed, dtype, device)


class MLP(nn.Module):
    """The transformer's MLP block: fc1 (d_model -> d_hidden), GELU, fc2 (d_hidden -> d_model)."""

    def __init__(self, d_model, d_hidden, bias=True):
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_hidden, bias=bias)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(d_hidden, d_model, bias=bias)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def attend(qkv, n_heads, causal=True):
    """Causal self-attention of `n_heads` heads, from the fused projection `qkv`.

    qkv: (batch, seq, n_heads * 3 * d_head), laid out head by head as [q, k, v] of d_head each.
    Returns (batch, seq, n_heads * d_head), heads side by side in the same order. Each head only
    reads its own 3·d_head features: any contiguous group of heads can be computed on its own.
    """
    batch, seq, width = qkv.shape
    if width % (3 * n_heads):
        raise ValueError(f"attend: the last dimension of qkv ({width}) is not n_heads x 3 x d_head for "
                         f"n_heads = {n_heads}")
    d_head = width // (3 * n_heads)
    q, k, v = qkv.view(batch, seq, n_heads, 3, d_head).permute(3, 0, 2, 1, 4)  # each (b, heads, s, d_head)
    scores = q @ k.transpose(-2, -1) / math.sqrt(d_head)
    if causal:
        future = torch.ones(seq, seq, dtype=torch.bool, device=qkv.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v                                    # (b, heads, s, d_head)
    return out.transpose(1, 2).reshape(batch, seq, n_heads * d_head)


class SelfAttention(nn.Module):
    """Causal multi-head self-attention: proj(attend(qkv(x), n_heads)), x of shape (batch, seq, d_model)."""

    def __init__(self, d_model, n_heads, bias=True):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model = {d_model} is not divisible by n_heads = {n_heads}")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x):
        return self.proj(attend(self.qkv(x), self.n_heads))


def mlp(d_model=8, d_hidden=32, bias=True, seed=0, dtype=torch.float64, device=None):
    """The unsharded MLP, initialised from `seed` (the same on every rank and in every test cell)."""
    return _seeded(lambda: MLP(d_model, d_hidden, bias), seed, dtype, device)


def self_attention(d_model=8, n_heads=4, bias=True, seed=0, dtype=torch.float64, device=None):
    """The unsharded causal self-attention, initialised from `seed`."""
    return _seeded(lambda: SelfAttention(d_model, n_heads, bias), seed, dtype, device)


def inputs(shape, seed, dtype=torch.float64):
    """A reproducible standard-normal tensor (on the CPU): the same in every rank and test cell."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)
