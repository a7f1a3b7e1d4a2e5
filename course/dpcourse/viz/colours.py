"""One colour per rank, and pictures whose colours say which rank holds (or contributed) what.

Used by notebooks 00, 05 and 06 (`plot_shards`: which rank holds which sample) and 03-04 (the
collectives explorer and the ring replay, through `draw_cell`, `rank_axis`, `legend`).

The trick behind the pictures of notebooks 03-04: run the real communication on inputs
where rank r holds 2**r everywhere. A sum of contributions is then a bit mask -- the value
13 = 0b1101 means "ranks 0, 2 and 3 have been added in" -- so the colours are read off
the learner's own data, not drawn from what the algorithm is supposed to do. A cell is
split into stripes, one per contributing rank, in that rank's colour; a value that is not
a valid mask (a contribution added twice, a lost one) is drawn black with a "?".
"""

import matplotlib.pyplot as plt

RANK_COLOURS = plt.get_cmap("tab10")


BAD = "#222222"  # not a rank colour: a value that is no sum of distinct ranks


def ranks_in(value, world_size):
    """The ranks whose 2**r contribution `value` sums, or None if it is not such a sum."""
    value = float(value)
    if value != int(value) or not 0 < value < 2 ** world_size:
        return None
    return [r for r in range(world_size) if int(value) >> r & 1]


def rank_colour(rank):
    return RANK_COLOURS(rank % 10)


def draw_cell(ax, x, y, contributors, text="", width=0.92, height=0.8, text_colour="white",
              fontsize=8):
    """One element at (x, y): stripes in the colours of `contributors`; None is drawn as invalid."""
    if contributors is None:
        ax.add_patch(plt.Rectangle((x, y), width, height, color=BAD))
        text = text or "?"
    elif not contributors:
        ax.add_patch(plt.Rectangle((x, y), width, height, facecolor="white", edgecolor="#bbbbbb",
                                   linestyle="--"))
        text_colour = "#888888"
    else:
        stripe = width / len(contributors)
        for i, rank in enumerate(contributors):
            ax.add_patch(plt.Rectangle((x + i * stripe, y), stripe, height, color=rank_colour(rank)))
    if text:
        ax.text(x + width / 2, y + height / 2, text, ha="center", va="center", fontsize=fontsize,
                color=text_colour, fontweight="bold")


def rank_axis(ax, world_size, label_x=-0.3):
    """Rows are ranks, rank 0 at the top."""
    ax.set_ylim(world_size, -0.2)
    ax.set_yticks([r + 0.4 for r in range(world_size)], [f"rank {r}" for r in range(world_size)])
    for tick, r in zip(ax.get_yticklabels(), range(world_size), strict=True):
        tick.set_color(rank_colour(r))
    ax.spines[:].set_visible(False)


def legend(ax, world_size):
    handles = [plt.Rectangle((0, 0), 1, 1, color=rank_colour(r)) for r in range(world_size)]
    ax.legend(handles, [f"from rank {r}" for r in range(world_size)], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)


def plot_shards(shards, length, title="which rank holds which sample"):
    """One row per rank, one square per sample index, in the colour of the rank that holds it.

    `shards[r]` is the list (or 1-D tensor) of sample indices rank r holds. A sample
    held twice or never shows up at once: a gap or a doubled column.
    """
    fig, ax = plt.subplots(figsize=(min(12, 1 + 0.35 * length), 0.5 + 0.45 * len(shards)))
    for rank, shard in enumerate(shards):
        for index in [int(i) for i in shard]:
            draw_cell(ax, index, rank, [rank], str(index), width=0.9, fontsize=7)
    ax.set_xlim(0, max(length, 1))
    rank_axis(ax, len(shards))
    ax.set_ylim(len(shards), 0)
    ax.set_xlabel("sample index")
    ax.set_title(title)
    plt.show()
