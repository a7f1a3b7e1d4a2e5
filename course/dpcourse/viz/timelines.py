"""Draw a timeline: labelled rows of bars on a shared time axis, and tick marks for instants.

Used by the timelines of notebooks 02 (one nn.DataParallel iteration, topics.data_parallel.timeline)
and 05 (one DDP step per rank, topics.ddp.timeline); any later picture of who was busy when
(pipeline stages, micro-batches) draws its bars here too.

Why one helper: what is particular to a timeline is what its bars mean (phases, layers, buckets),
not how rows are laid out, labelled and spaced; rows come in groups (one per rank, say) with a gap
between groups, the first row at the top.
"""

from dataclasses import dataclass

GAP = 0.4  # space between two groups of rows, in rows


@dataclass
class Span:
    """One bar: on row `row` (its index in reading order), from `start` to `end` in the axis' unit."""

    row: int
    start: float
    end: float
    colour: object
    label: str = ""  # written in the middle of the bar
    edge: object = None  # outline colour (None: no outline)
    text_colour: str = "black"
    linewidth: float = 1.5  # of the outline


def draw_timeline(ax, groups, spans, ticks=(), xlabel="", height=0.7, min_width=0.0):
    """Draw `spans` (and `ticks`, (row, x, colour) instants) on rows named by `groups`.

    `groups` is a list of lists of row labels: rows are numbered in reading order across groups,
    and each group after the first starts after a gap. Bars narrower than `min_width` are drawn
    that wide, so an instant phase still shows. Returns the y of each row (top row first).
    """
    ys, y = [], 0.0
    for group in groups:
        for _ in group:
            ys.append(y)
            y += 1.0
        y += GAP
    for span in spans:
        width = max(span.end - span.start, min_width)
        ax.broken_barh([(span.start, width)], (ys[span.row] - height / 2, height), facecolors=span.colour,
                       edgecolors=span.edge if span.edge is not None else "none", linewidth=span.linewidth)
        if span.label:
            ax.text(span.start + width / 2, ys[span.row], span.label, ha="center", va="center", fontsize=7,
                    color=span.text_colour)
    for row, x, colour in ticks:
        ax.plot([x, x], [ys[row] - 0.35, ys[row] + 0.35], color=colour, lw=1.5)
    ax.set_yticks(ys, [label for group in groups for label in group])
    ax.set_ylim(ys[-1] + 0.6, -0.6)
    ax.set_xlabel(xlabel)
    ax.spines[["top", "right"]].set_visible(False)
    return ys
