"""Small matplotlib pictures the notebooks draw from the learner's own results."""

import matplotlib.pyplot as plt


def plot_shards(shards, length, title="which rank holds which sample"):
    """One row per rank, one square per sample index, coloured by the rank that holds it.

    `shards[r]` is the list (or 1-D tensor) of sample indices rank r holds. A sample
    held twice or never shows up at once: a gap or a doubled column.
    """
    fig, ax = plt.subplots(figsize=(min(12, 1 + 0.35 * length), 0.5 + 0.45 * len(shards)))
    colours = plt.get_cmap("tab10")
    for rank, shard in enumerate(shards):
        for index in [int(i) for i in shard]:
            ax.add_patch(plt.Rectangle((index, rank), 0.9, 0.8, color=colours(rank % 10)))
            ax.text(index + 0.45, rank + 0.4, str(index), ha="center", va="center", fontsize=7,
                    color="white")
    ax.set_xlim(0, max(length, 1))
    ax.set_ylim(len(shards), 0)
    ax.set_yticks([r + 0.4 for r in range(len(shards))], [f"rank {r}" for r in range(len(shards))])
    ax.set_xlabel("sample index")
    ax.set_title(title)
    ax.spines[:].set_visible(False)
    plt.show()
