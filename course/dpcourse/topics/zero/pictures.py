"""Pictures of notebook 10 drawn from your own runs: memory per rank by stage, and when each unit of
your MiniFSDP holds its full parameters.

Why a module: the numbers of a ZeRO run (bytes per kind, alloc/free events) are easy to
print and hard to read; a stacked bar per stage and a timeline per unit show the point at
a glance -- what each stage removes, and that ZeRO-3 keeps only one or two units whole.
"""

from dpcourse.topics.zero.memory import KINDS

COLOURS = {"weights": "#4C72B0", "gradients": "#DD8452", "optimizer": "#55A868"}


def plot_memory(measured, formula=None, title=None, unit="kB"):
    """Stacked bars per stage (weights, gradients, optimizer state) for one rank.

    measured: {stage: {kind: bytes}}; formula: the same shape, drawn as an outline next to
    each measured bar. Shows the figure and returns nothing: a figure returned by the last line of a
    cell would be drawn a second time.
    """
    import matplotlib.pyplot as plt

    scale = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}[unit]
    colours = COLOURS
    stages = list(measured)
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * len(stages), 3.6))
    left = -0.18 if formula is not None else 0.0
    for i, stage in enumerate(stages):
        bottom = 0.0
        for kind in KINDS:
            height = measured[stage][kind] / scale
            ax.bar(i + left, height, 0.34, bottom=bottom, color=colours[kind],
                   label=kind if i == 0 else None)
            bottom += height
        ax.text(i + left, bottom, f"{bottom:.3g}", ha="center", va="bottom", fontsize=8)
        if formula is not None:
            bottom = 0.0
            for kind in KINDS:
                height = formula[stage][kind] / scale
                ax.bar(i + 0.18, height, 0.34, bottom=bottom, facecolor="none", edgecolor=colours[kind],
                       hatch="//", label=f"{kind} (formula)" if i == 0 else None)
                bottom += height
    ax.set_xticks(range(len(stages)), stages)
    ax.set_ylabel(f"{unit} per rank")
    if title:
        ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    plt.show()


def plot_unit_timeline(events, title=None):
    """One row per unit: a bar while the unit is unsharded (between alloc and free), from a
    UnitRecorder log; forward in blue, backward in orange, steps separated by the log's marks.
    The x axis counts events (alloc, free), not seconds: the order is what matters. Shows the figure,
    returns nothing (as plot_memory)."""
    import matplotlib.pyplot as plt

    units = []
    for what, name, _, _ in events:
        if what in ("create", "alloc", "free") and name not in units:
            units.append(name)
    start = next((i for i, e in enumerate(events) if e[0] == "mark"), 0)
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(units) + 1.2))
    opened, x = {}, 0
    for what, name, _, _ in events[:start]:  # units left whole by the constructor
        if what in ("create", "alloc"):
            opened[name] = (0, False)
        elif what == "free":
            opened.pop(name, None)
    for what, name, in_backward, _ in events[start:]:
        if what == "mark":
            ax.axvline(x, color="grey", lw=0.8, ls=":")
            ax.text(x, len(units) - 0.4, name, fontsize=7, color="grey", ha="left", va="bottom")
            continue
        x += 1
        if what == "alloc":
            opened[name] = (x, in_backward)
        elif what == "free" and name in opened:
            begin, backward = opened.pop(name)
            row = units.index(name)
            ax.barh(row, x - begin, left=begin, color="#DD8452" if backward else "#4C72B0", height=0.6)
    for name, (begin, _) in opened.items():  # never freed: draw to the end, hatched
        ax.barh(units.index(name), x + 1 - begin, left=begin, color="none", edgecolor="red", hatch="//",
                height=0.6)
    ax.set_yticks(range(len(units)), units)
    ax.invert_yaxis()
    ax.set_xlabel("alloc / free events, in order (blue: gathered for forward, orange: for backward)")
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    plt.show()
