"""What each layer costs, and a picture of how a partition spreads those costs over stages.

    names, flops = gpt_layer_flops(n_layers=24, hidden=2048, seq=2048, vocab=50257)   # GPT-3 XL, 1.3B
    seconds = measure_layer_costs(model, x)        # forward + backward time of each layer, here
    plot_partition(flops, [0, 7, 13, 19, 26], names)

Why: a pipeline runs at the pace of its slowest stage, so cutting a model into stages
is a balancing problem, and its input is a cost per layer. Two sources of costs:
  * a formula: a GPT block's forward takes 24 b s h^2 + 4 b s^2 h floating-point
    operations for b sequences of s tokens with hidden size h, and the output layer
    2 b s h V for a vocabulary of V (Narayanan et al., "Efficient Large-Scale Language Model
    Training on GPU Clusters Using Megatron-LM", 2021, section 5.1); the embedding lookup is
    almost free. A backward costs about twice its forward, the same factor for every layer,
    so the forward counts are enough to balance stages;
  * a measurement: time each layer's forward and backward on a sample batch.

Used by notebook 07 (exercise partition_layers and its demos).
"""

import statistics
import time
from itertools import pairwise

import matplotlib.pyplot as plt
import torch

from dpcourse.viz.colours import rank_colour


def gpt_layer_flops(n_layers, hidden, seq, vocab, batch=1):
    """(names, forward FLOPs) of a GPT's layers in order: the embedding, n_layers blocks, the output layer."""
    block = 24 * batch * seq * hidden ** 2 + 4 * batch * seq ** 2 * hidden
    head = 2 * batch * seq * hidden * vocab
    names = ["embedding"] + [f"block {i}" for i in range(n_layers)] + ["output layer"]
    return names, [0] + [block] * n_layers + [head]


def measure_layer_costs(model, x, repeats=5):
    """Median seconds of each layer's forward + backward on x (an nn.Sequential, layer by layer)."""
    times = [[] for _ in model]
    for _ in range(repeats):
        h = x
        for i, layer in enumerate(model):
            h = h.detach().requires_grad_()
            start = time.perf_counter()
            out = layer(h)
            out.backward(torch.ones_like(out))
            times[i].append(time.perf_counter() - start)
            h = out
    model.zero_grad(set_to_none=True)
    return [statistics.median(t) for t in times]


def stage_costs(costs, cuts):
    """The summed cost of each stage's layers."""
    return [sum(costs[a:b]) for a, b in pairwise(cuts)]


def plot_partition(costs, cuts, names=None, ax=None, title="", unit=1.0, unit_name=""):
    """Bars: each layer's cost in its stage's colour; the slowest stage's total is marked."""
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 2.6))
    totals = stage_costs(costs, cuts)
    slowest = max(range(len(totals)), key=totals.__getitem__)
    for s, (a, b) in enumerate(pairwise(cuts)):
        ax.bar(range(a, b), [c / unit for c in costs[a:b]], color=rank_colour(s), width=0.85,
               label=f"stage {s}: {totals[s] / unit:.3g}{unit_name}" + (" (slowest)" if s == slowest else ""))
    if names is not None and len(names) <= 30:
        ax.set_xticks(range(len(costs)), names, rotation=90, fontsize=7)
    ax.set_ylabel(f"cost{f' ({unit_name.strip()})' if unit_name else ''}")
    ax.legend(fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(title or f"cuts {list(cuts)}: the slowest stage costs "
                          f"{totals[slowest] / unit:.3g}{unit_name}", fontsize=10)
    ax.spines[["top", "right"]].set_visible(False)
    return ax
