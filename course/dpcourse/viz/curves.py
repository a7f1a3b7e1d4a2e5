"""Tiny training loops for the notebooks' curves: any step function, minibatches, progress, a plot.

Used by notebooks 01 and 02 (training curves).

The notebooks compare ways of taking a step (one worker, K simulated workers,
N real ranks, a bigger batch with a scaled learning rate) on the same data in
the same order. `train_curve` owns what stays the same -- shuffling with a
fixed seed, cutting minibatches, evaluating after each epoch, a tqdm bar on
stdout -- and calls the step being compared. `plot_curves` draws them against
the number of samples seen, the fair x-axis when batch sizes differ.
"""

import sys

import matplotlib.pyplot as plt
import torch
from tqdm.auto import tqdm


def train_curve(step, evaluate, n, batch, epochs, seed=0, desc="training", progress=True):
    """Run `epochs` passes over n samples in shuffled minibatches of `batch` (a last partial batch
    is dropped); call `step(indices, step_number)` for each, `evaluate()` after each epoch.

    Returns [(samples seen, evaluate()), ...], starting with (0, evaluate()) before training.
    """
    g = torch.Generator().manual_seed(seed)
    steps_per_epoch = n // batch
    curve, seen, number = [(0, evaluate())], 0, 0
    bar = tqdm(total=epochs * steps_per_epoch, desc=desc, file=sys.stdout, disable=not progress,
               leave=True)
    for _ in range(epochs):
        order = torch.randperm(n, generator=g)
        for i in range(steps_per_epoch):
            step(order[i * batch:(i + 1) * batch], number)
            seen += batch
            number += 1
            bar.update()
        curve.append((seen, evaluate()))
    bar.close()
    return curve


def warmup_factor(step_number, warmup_steps):
    """The learning-rate multiplier of a linear warm-up: 1/w, 2/w, ..., then 1 from step w on."""
    return min(1.0, (step_number + 1) / warmup_steps) if warmup_steps else 1.0


def plot_curves(curves, title="", ylabel="loss on the whole data set", log=False, ax=None):
    """curves: {label: [(samples seen, value), ...]}. One line per curve, markers at each epoch."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    styles = ["-", "--", ":", "-.", (0, (5, 1)), (0, (1, 1))]
    for i, (label, curve) in enumerate(curves.items()):
        xs, ys = zip(*curve, strict=True)
        ax.plot(xs, ys, linestyle=styles[i % len(styles)], marker="o", markersize=3, label=label)
    ax.set_xlabel("samples seen")
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.legend(fontsize=8)
    plt.show()
    return ax
