"""The mixture-of-experts layer expert parallelism must reproduce, and its routing written out.

    moe = mixture(d_model=8, d_hidden=16, n_experts=4, k=2, capacity_factor=1.0, seed=0)
    out = route(moe, x)                  # one process, one group of tokens: see `route`
    out["y"], out["aux_loss"], out["kept"], out["dropped"], out["load"]

Why a module: an expert-parallel layer is right when each rank's output is what the
single-process layer computes on that rank's tokens, dropped tokens included; so every rank
and test cell rebuilds the same layer from a seed (float64), and the reference routing is
written here with plain loops, independently of any vectorised trick a learner might use.

The rules (notebook 12 states them, this is their one implementation):
  router    a bias-free Linear, d_model -> n_experts; probabilities p = softmax(logits)
  top-k     each token's k most probable experts; the gate of a choice is its probability (k = 1,
            Switch Transformer) or its probability over the sum of the token's k (k = 2, GShard)
  capacity  C = ceil(capacity_factor · k · T / E) token-choices per expert, for a group of T
            tokens (one rank's tokens: GShard's "group"); choices are served in order -- every
            token's first choice in token order, then every second choice -- and an expert
            takes the first C that reach it: the rest are dropped (they add nothing to y)
  output    y[t] = sum over t's kept choices of gate · expert(x[t])
  aux loss  alpha · E · sum_i f_i · P_i (Fedus et al. 2021, eq. 4), f_i the fraction of the
            T tokens whose first choice (argmax of p) is expert i, P_i the mean of p_i over the
            T tokens; alpha = 0.01, the paper's value. f_i counts the router's choices, before
            any token is dropped.
"""

import math

import torch
from torch import nn

from dpcourse.backend import rank_device

ALPHA = 0.01  # Switch Transformer's coefficient of the load-balancing loss


class Expert(nn.Module):
    """One expert: fc2(GELU(fc1(x))), d_model -> d_hidden -> d_model."""

    def __init__(self, d_model, d_hidden):
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(d_hidden, d_model)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class MixtureOfExperts(nn.Module):
    """A router and E experts; forward(x) -> (y, aux_loss) for one group of tokens x (T, d_model)."""

    def __init__(self, d_model, d_hidden, n_experts, k=1, capacity_factor=1.0):
        super().__init__()
        if k not in (1, 2):
            raise ValueError(f"k = {k}: top-1 (Switch) or top-2 (GShard) routing")
        self.k, self.capacity_factor = k, capacity_factor
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d_model, d_hidden) for _ in range(n_experts))

    def forward(self, x):
        out = route(self, x)
        return out["y"], out["aux_loss"]


def mixture(d_model=8, d_hidden=16, n_experts=4, k=1, capacity_factor=1.0, seed=0, dtype=torch.float64,
            device=None, router_scale=1.0):
    """The unsharded layer, initialised from `seed`. router_scale multiplies the router's weight
    (a larger one makes routing more decisive)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        moe = MixtureOfExperts(d_model, d_hidden, n_experts, k, capacity_factor)
        with torch.no_grad():
            moe.router.weight.mul_(router_scale)
    return moe.to(dtype=dtype, device=device if device is not None else rank_device())


def capacity(tokens, n_experts, k, capacity_factor):
    """Token-choices each expert accepts from a group of `tokens` tokens."""
    return math.ceil(capacity_factor * k * tokens / n_experts)


def choices(logits, k):
    """(probabilities, experts (T, k), gates (T, k)) of the top-k rule above."""
    probs = torch.softmax(logits, dim=-1)
    top, experts = probs.topk(k, dim=-1)
    gates = top if k == 1 else top / top.sum(dim=-1, keepdim=True)
    return probs, experts, gates


def served(experts, cap, n_experts):
    """kept (T, k) booleans: first choices in token order, then second choices, C per expert."""
    tokens, k = experts.shape
    taken, kept = [0] * n_experts, torch.zeros(tokens, k, dtype=torch.bool)
    for choice in range(k):
        for t in range(tokens):
            e = int(experts[t, choice])
            if taken[e] < cap:
                taken[e] += 1
                kept[t, choice] = True
    return kept


def aux_loss(probs, experts, alpha=ALPHA):
    """alpha · E · sum_i f_i · P_i, f_i from the first choices (see the module docstring)."""
    tokens, n_experts = probs.shape
    first = torch.zeros(n_experts, dtype=probs.dtype)
    for t in range(tokens):
        first[int(experts[t, 0])] += 1
    return alpha * n_experts * ((first / tokens) * probs.mean(dim=0)).sum()


def route(moe, x, alpha=ALPHA, drop=True, gated=True):
    """Everything the layer computes for one group of tokens (one process, float64).

    {"y": (T, d) output, "aux_loss", "experts" (T, k), "gates" (T, k), "kept" (T, k) bool,
     "dropped": choices over capacity, "load": tokens whose first choice is each expert, "capacity"}
    drop=False keeps every choice, gated=False weighs every kept choice by 1: known mistakes,
    for messages.
    """
    n_experts = len(moe.experts)
    probs, experts, gates = choices(moe.router(x), moe.k)
    if not gated:
        gates = torch.ones_like(gates)
    cap = capacity(x.shape[0], n_experts, moe.k, moe.capacity_factor)
    kept = served(experts, cap if drop else x.shape[0] * moe.k, n_experts)
    y = torch.zeros_like(x)
    for e, expert in enumerate(moe.experts):
        where = (experts == e) & kept
        tokens = where.any(dim=1).nonzero().flatten()
        if len(tokens):
            gate = (gates * where).sum(dim=1)[tokens]
            y = y.index_add(0, tokens, expert(x[tokens]) * gate.unsqueeze(1))
    load = torch.bincount(experts[:, 0], minlength=n_experts)
    return {"y": y, "aux_loss": aux_loss(probs, experts, alpha), "experts": experts, "gates": gates,
            "kept": kept, "dropped": int((~kept).sum()), "load": load, "capacity": cap}


def tokens_towards(full, expert, tokens, seed=0):
    """`tokens` tokens (float64, d_model wide) whose first choice is `expert` in the layer mixture(**full):
    its router's row for that expert, plus a little noise. Every token then goes to one expert, and the
    ranks holding the others receive none (notebook 12's trap for expert parallelism's backward)."""
    moe = mixture(**dict(full, device="cpu"))
    row = moe.router.weight.detach()[expert]
    noise = torch.randn((tokens, row.numel()), generator=torch.Generator().manual_seed(seed),
                        dtype=torch.float64)
    x = 6.0 * row / row.norm() + 0.05 * noise
    _, experts, _ = choices(moe.router(x).detach(), 1)
    if not bool((experts[:, 0] == expert).all()):
        raise ValueError(f"tokens_towards: the tokens missed expert {expert} (seed {seed}): pick another "
                         "seed")
    return x


def dense_twin(moe, dtype=torch.float64, seed=0):
    """A dense MLP doing the FLOPs of one token's k experts: d_model -> k·d_hidden -> d_model (the
    baseline of `make bench`: what expert parallelism is compared with)."""
    expert = moe.experts[0]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        dense = Expert(expert.fc1.in_features, moe.k * expert.fc1.out_features)
    return dense.to(dtype=dtype, device=expert.fc1.weight.device)
