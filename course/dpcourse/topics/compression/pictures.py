"""Pictures of notebook 11 drawn from the learner's runs: which coordinates top-k updated, and how well.

Why: "error feedback matters" is easiest to believe when you see it. With the same gradient at every
step, top-k without error feedback sends the same k coordinates forever and the others never move;
with error feedback every coordinate's residual grows until it is among the k largest, so every
coordinate is sent now and then and the sum of the updates tracks the sum of the gradients.
"""

import matplotlib.pyplot as plt
import torch


def updated_coordinates(averages):
    """How many coordinates were nonzero in at least one of the averages."""
    return int((torch.stack(list(averages)) != 0).any(0).sum())


def relative_error(averages, target):
    """|sum of the averages - target| / |target|: how far the summed updates are from the true sum."""
    return float((sum(averages) - target).norm() / target.norm())


def plot_sent(runs, title=""):
    """runs: {label: list of per-step averages}. One panel per run: steps down, coordinates across,
    coloured where the step's average was nonzero (the coordinate was sent by some rank)."""
    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 3.2), squeeze=False)
    for ax, (label, averages) in zip(axes[0], runs.items(), strict=True):
        mask = (torch.stack(list(averages)) != 0).float().numpy()
        ax.imshow(mask, aspect="auto", cmap="Blues", interpolation="nearest", vmin=0, vmax=1)
        ax.set_title(f"{label}: {updated_coordinates(averages)} of {mask.shape[1]} coordinates ever sent",
                     fontsize=9)
        ax.set_xlabel("coordinate")
        ax.set_ylabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    plt.show()
