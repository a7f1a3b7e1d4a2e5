"""A small GPT (decoder-only transformer) that every parallel layout of notebook 13 splits the same way.

Used by notebook 13 (the capstone: data x pipeline x tensor parallelism on 8 ranks), its hidden checks
and its benchmark.

    config = GPTConfig(vocab=16, seq=128, d_model=128, n_heads=4, n_layers=4)   # ~0.8M parameters
    model = gpt(config, seed=0)                        # the same model on every rank and in the reference
    logits = model(tokens)                              # tokens (batch, seq) -> logits (batch, seq, vocab)

The shape is GPT-2's (Radford et al. 2019): token and position embeddings, pre-LayerNorm blocks of causal
multi-head attention and an MLP (d_model -> 4 d_model -> d_model, GELU), a final LayerNorm and an untied LM
head. Written for torch's parallel APIs the way torchtitan writes its Llama:
  * q, k and v are three Linears (not one fused one): a column-parallel split of each keeps whole heads on a
    rank, and attention reshapes with `view(batch, seq, -1, d_head)`, so a rank computes whatever heads it
    holds (n_heads / tp of them);
  * the blocks live in a ModuleDict keyed "0", "1", ...: a pipeline stage deletes the blocks it does not
    run (and the embeddings or the head) and keeps the names, so a stage's state_dict keys are the whole
    model's (`stage_of`), which is what lets a checkpoint saved in one layout load into another;
  * activations are (batch, seq, d_model): the sequence is dim 1, torch's SequenceParallel default.
Dropout is `ShardedDropout` (below), the same in every layout; with p = 0 (the default) it does nothing.
"""

import copy
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 16  # dpcourse.toys.text's alphabet
    seq: int = 128
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 4
    d_hidden: int = 0  # 0: 4 * d_model
    dropout: float = 0.0

    @property
    def hidden(self):
        return self.d_hidden or 4 * self.d_model

    def as_dict(self):
        return asdict(self)


def parameter_count(config):
    """Parameters of gpt(config), counted from the shapes (what `sum(p.numel())` gives)."""
    d, h, v, s = config.d_model, config.hidden, config.vocab, config.seq
    block = 4 * (d * d + d) + (d * h + h) + (h * d + d) + 2 * 2 * d
    return v * d + s * d + config.n_layers * block + 2 * d + (d * v + v)


class ShardedDropout(nn.Module):
    """Dropout whose mask is the whole tensor's, whatever piece of it this rank holds.

    torch draws a DTensor's dropout mask as if on the whole tensor only on CUDA-like devices
    (torch/distributed/tensor/_random.py: `OffsetBasedRNGTracker` refuses a CPU mesh); on a CPU mesh each
    rank draws a mask for its own piece. Here every call draws the mask of the *global* shape from the
    default generator and keeps this rank's piece of it: a DTensor input (sequence-parallel region) keeps
    its local shard, a plain tensor the whole mask. So ranks agree with one process exactly when their
    generators agree: the same seed on every rank of the group, as torch asks of DTensor programs.
    """

    def __init__(self, p=0.0):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        keep = torch.rand(tuple(x.shape), dtype=torch.float64) >= self.p  # x.shape: the global shape
        local = x
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # pragma: no cover - torch without DTensor
            DTensor = ()
        if isinstance(x, DTensor):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            shape, offset = compute_local_shape_and_global_offset(x.shape, x.device_mesh, x.placements)
            keep = keep[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
            local = x.to_local()
            out = local * keep.to(local.device, local.dtype) / (1.0 - self.p)
            return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False)
        return local * keep.to(local.device, local.dtype) / (1.0 - self.p)


class Attention(nn.Module):
    """Causal multi-head self-attention; a rank holding some of the heads (tensor parallel) computes those."""

    def __init__(self, config):
        super().__init__()
        d = config.d_model
        self.d_head = d // config.n_heads
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, s = x.shape[0], x.shape[1]
        q, k, v = (layer(x).view(b, s, -1, self.d_head).transpose(1, 2) for layer in (self.q, self.k, self.v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_head)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        y = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc1 = nn.Linear(config.d_model, config.hidden)
        self.fc2 = nn.Linear(config.hidden, config.d_model)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """x + drop(attn(norm1(x))), then + drop(mlp(norm2(x))): pre-LayerNorm, as GPT-2."""

    def __init__(self, config):
        super().__init__()
        self.norm1, self.attn, self.drop1 = nn.LayerNorm(config.d_model), Attention(config), \
            ShardedDropout(config.dropout)
        self.norm2, self.mlp, self.drop2 = nn.LayerNorm(config.d_model), MLP(config), \
            ShardedDropout(config.dropout)

    def forward(self, x):
        x = x + self.drop1(self.attn(self.norm1(x)))
        return x + self.drop2(self.mlp(self.norm2(x)))


class GPT(nn.Module):
    """tokens (batch, seq) -> logits (batch, seq, vocab). A pipeline stage is a GPT with some parts set to
    None (`stage_of`): without the embeddings it takes the previous stage's activations."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab, config.d_model)
        self.pos = nn.Embedding(config.seq, config.d_model)
        self.blocks = nn.ModuleDict({str(i): Block(config) for i in range(config.n_layers)})
        self.norm = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab)

    def forward(self, x):
        if self.tok is not None:
            positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)  # (1, seq): dim 1 is seq
            x = self.tok(x) + self.pos(positions)
        for block in self.blocks.values():
            x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)
        return x


def gpt(config, seed=0, dtype=torch.float32, device=None):
    """GPT(config) initialised from `seed` (GPT-2's N(0, 0.02) weights, zero biases), without touching
    the global random state: every rank and the reference build the same model."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(config)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif "norm" not in name:
                nn.init.normal_(p, std=0.02)
    return model.to(dtype=dtype, device=device)


def stage_of(model, first, last):
    """A copy of `model` that runs blocks [first, last) only: the embeddings only when first == 0, the
    final norm and head only when last == n_layers. The blocks keep their names ("2", "3"), so the stage's
    parameter names are the whole model's (torchtitan's pipeline split works the same way)."""
    n = len(model.blocks)
    if not 0 <= first < last <= n:
        raise ValueError(f"a stage runs blocks [{first}, {last}) of {n}: need 0 <= first < last <= {n}")
    stage = copy.deepcopy(model)
    for i in range(n):
        if not first <= i < last:
            del stage.blocks[str(i)]
    if first > 0:
        stage.tok = stage.pos = None
    if last < n:
        stage.norm = stage.head = None
    return stage


def activations(shape, seed, dtype=torch.float64):
    """A seeded standard-normal tensor: a block's input, or its output's gradient, in notebook 13's tests."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def lm_loss(logits, targets):
    """Next-character cross-entropy, the mean over every position of every sequence."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
