"""See a batch split over N workers, each worker's gradient, and what averaging them gives.

Used by notebook 01 (shard_explorer).

The model is a line, y = w x + b, so a gradient is an arrow in the (w, b) plane:
each worker's arrow comes from its own shard, and the arrow data-parallel
training uses is their average. Drawn next to the gradient of the whole batch,
it shows at a glance when averaging is exact (equal shards), when it needs
weights (unequal shards), and what padding or dropping samples changes.
`shard_explorer(shard_indices)` puts sliders on it, driven by the learner's
own sharding function.
"""

import matplotlib.pyplot as plt
import torch
from torch import nn

from dpcourse.toys.data import line_data
from dpcourse.toys.models import linear
from dpcourse.viz.widgets import explorer

POLICIES = ("spread", "drop", "pad")


def shard_gradients(shards, x, y, model):
    """Per-worker gradients (w, b) of the mean squared error on each non-empty shard.

    Returns (sizes, gradients): sizes[k] samples, gradients[k] a tensor of 2 values or None.
    """
    sizes, grads = [], []
    for shard in shards:
        index = torch.as_tensor(shard, dtype=torch.long)
        sizes.append(len(index))
        if len(index) == 0:
            grads.append(None)
            continue
        loss = nn.functional.mse_loss(model(x[index]), y[index])
        gw, gb = torch.autograd.grad(loss, [model.weight, model.bias])
        grads.append(torch.stack([gw.flatten()[0], gb.flatten()[0]]).detach())
    return sizes, grads


def plot_shard_gradients(shards, x, y, model, title=""):
    """Left: the samples coloured by the worker holding them. Right: gradients as arrows.

    Arrows: one per worker (its colour), the plain mean of the workers' arrows
    (dashed), the mean weighted by shard sizes (solid black) and the gradient of
    the whole batch (a star). Returns the figure.
    """
    n = len(x)
    colours = plt.get_cmap("tab10")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    holders = [[] for _ in range(n)]
    for rank, shard in enumerate(shards):
        for i in torch.as_tensor(shard, dtype=torch.long).tolist():
            if 0 <= i < n:
                holders[i].append(rank)
    for i in range(n):
        xi, yi = x[i, 0].item(), y[i, 0].item()
        if not holders[i]:
            left.scatter(xi, yi, facecolors="none", edgecolors="grey", s=40)
        for k, rank in enumerate(holders[i]):
            left.scatter(xi, yi, color=colours(rank % 10), s=40 + 60 * k, zorder=3 - k)
    left.set_title("samples, coloured by worker (hollow: unused, ringed: used twice)", fontsize=9)
    left.set_xlabel("x")
    left.set_ylabel("y")

    sizes, grads = shard_gradients(shards, x, y, model)
    full = shard_gradients([range(n)], x, y, model)[1][0]
    present = [(s, g) for s, g in zip(sizes, grads, strict=True) if g is not None]
    for rank, g in enumerate(grads):
        if g is not None:
            right.annotate("", xy=g.tolist(), xytext=(0, 0),
                           arrowprops=dict(arrowstyle="->", color=colours(rank % 10), lw=1.5))
            right.text(*g.tolist(), f" worker {rank} ({sizes[rank]})", fontsize=7,
                       color=colours(rank % 10))
    points = [full]
    if present:
        plain = torch.stack([g for _, g in present]).mean(0)
        weighted = sum(s * g for s, g in present) / sum(s for s, _ in present)
        right.annotate("", xy=plain.tolist(), xytext=(0, 0),
                       arrowprops=dict(arrowstyle="->", color="black", lw=1.5, ls="--"))
        right.annotate("", xy=weighted.tolist(), xytext=(0, 0),
                       arrowprops=dict(arrowstyle="->", color="black", lw=2.5))
        right.plot([], [], "k--", label="plain mean of workers")
        right.plot([], [], "k-", lw=2.5, label="mean weighted by shard size")
        points += [plain, weighted, *[g for _, g in present]]
    right.plot(*full.tolist(), "k*", markersize=14, label="gradient of the whole batch")
    everything = torch.stack(points)
    pad = 0.15 * (everything.abs().max().item() + 1e-3)
    right.set_xlim(min(0, everything[:, 0].min().item()) - pad, max(0, everything[:, 0].max().item()) + pad)
    right.set_ylim(min(0, everything[:, 1].min().item()) - pad, max(0, everything[:, 1].max().item()) + pad)
    right.axhline(0, color="grey", lw=0.5)
    right.axvline(0, color="grey", lw=0.5)
    right.set_xlabel("dL/dw")
    right.set_ylabel("dL/db")
    right.legend(fontsize=7, loc="best")
    right.set_title("gradients of the mean loss (arrows) and the full-batch gradient (star)", fontsize=9)
    fig.suptitle(title)
    fig.tight_layout()
    plt.show()
    return fig


def shard_explorer(shard_indices, max_batch=40, max_workers=8, seed=3):
    """Sliders for the batch size and the number of workers, a menu for the remainder policy.

    `shard_indices(n, rank, world_size, remainder)` is the learner's function;
    if it raises (not written yet, or a bug), the error is shown instead of a plot.
    """
    import ipywidgets as widgets

    x, y = line_data(max_batch, seed=seed)
    model = linear(1, 1, seed=seed)

    def draw(batch, workers, remainder):
        try:
            shards = [shard_indices(batch, r, workers, remainder) for r in range(workers)]
        except Exception as exc:  # noqa: BLE001 - show the learner's error, keep the widget alive
            print(f"shard_indices raised {type(exc).__name__}: {exc}")
            return
        sizes = [len(s) for s in shards]
        plot_shard_gradients(shards, x[:batch], y[:batch], model,
                             title=f"{batch} samples over {workers} workers, remainder={remainder!r}: "
                                   f"shard sizes {sizes}")

    controls = dict(batch=widgets.IntSlider(value=10, min=1, max=max_batch, description="batch"),
                    workers=widgets.IntSlider(value=4, min=1, max=max_workers, description="workers"),
                    remainder=widgets.Dropdown(options=POLICIES, value="spread", description="remainder"))
    return explorer(controls, draw)
