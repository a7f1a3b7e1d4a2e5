"""The load of each expert and the dropped tokens, from a router's choices (notebook 12).

    plot_load(experts, kept, n_experts, capacity, title="your route_tokens on a skewed batch")

Why a picture: capacity and the load-balancing loss are about one histogram -- how many
token-choices reach each expert, how many it can take (the capacity line), and how many it drops.
The bars are drawn from what your router returned, not from the rules.
"""

import torch

from dpcourse.viz import colours


def load_of(experts, kept, n_experts):
    """(kept choices per expert, dropped choices per expert) as lists."""
    experts, kept = torch.as_tensor(experts), torch.as_tensor(kept, dtype=torch.bool)
    taken = torch.bincount(experts[kept].flatten(), minlength=n_experts)
    dropped = torch.bincount(experts[~kept].flatten(), minlength=n_experts)
    return taken.tolist(), dropped.tolist()


def plot_load(experts, kept, n_experts, capacity, title="token-choices per expert"):
    """Stacked bars per expert: kept choices (the expert's colour) and dropped ones (hatched), the
    capacity as a line."""
    import matplotlib.pyplot as plt

    taken, dropped = load_of(experts, kept, n_experts)
    _, ax = plt.subplots(figsize=(1.2 + 0.6 * n_experts, 2.8))
    for e in range(n_experts):
        ax.bar(e, taken[e], color=colours.rank_colour(e))
        ax.bar(e, dropped[e], bottom=taken[e], color="white", edgecolor=colours.rank_colour(e), hatch="//")
    ax.axhline(capacity, color="black", linestyle="--", linewidth=1)
    ax.text(n_experts - 0.5, capacity, f" capacity {capacity}", va="bottom", ha="right", fontsize=8)
    ax.set_xticks(range(n_experts), [f"expert {e}" for e in range(n_experts)], fontsize=8)
    ax.set_ylabel("token-choices")
    ax.set_title(f"{title}: {sum(dropped)} of {sum(taken) + sum(dropped)} dropped (hatched)", fontsize=9)
    plt.show()
    return taken, dropped
