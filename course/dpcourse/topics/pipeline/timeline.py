"""Draw a pipeline step as a Gantt chart, one row per stage, from a recorded run or a simulation.

    calls = run_pipeline(gpipe_step, case, exercise="gpipe_step")
    timelines = stage_timelines(calls, case)        # per stage: [(kind, i, start, end)], seconds from 0
    plot_timeline(timelines, title="GPipe")         # light boxes: forwards; dark: backwards; grey: bubble
    compare_timelines({"GPipe": a, "1F1B": b})      # side by side, same time scale
    timeline_slider({m: {"GPipe": a_m, "1F1B": b_m} for m in ...})   # a slider for m

Why: "the bubble" is a claim about time, and the way to believe the formula is to see
your own schedule drawn to scale, with the idle time shaded. The boxes come from hooks on
your stage's module (runner.StageWatch), so the picture is what your code did, not what
the textbook says it should do. Each micro-batch has its own colour: follow one through
the stages forward (light) and back (dark).

Used by notebook 07; notebook 09 draws its pipelines with it too.
"""


import matplotlib.pyplot as plt

from dpcourse.topics.pipeline.runner import by_stage
from dpcourse.topics.pipeline.schedules import idle_fraction
from dpcourse.viz.colours import rank_colour


def stage_timelines(calls, case):
    """Per stage, [(kind, micro-batch, start, end)] in seconds since the first forward began."""
    staged = [c.observed["events"] for c in by_stage(calls, case)]
    events = [e for timeline in staged for e in timeline]
    t0 = min((e[2] for e in events), default=0.0)
    return [[(kind, i, start - t0, (end if end is not None else start) - t0)
             for kind, i, start, end in timeline] for timeline in staged]


def measured_bubble(timelines):
    """The share of the step the stages spent outside their forwards and backwards."""
    return idle_fraction(timelines)


def typical_durations(timelines):
    """(mean forward, mean backward, step) in seconds: step from the first start to the last end.

    With these, the formula's step lasts (m + p - 1)(forward + backward); whatever a measured
    step takes beyond that went to messages and to waiting for a core.
    """
    events = [e for timeline in timelines for e in timeline]
    mean = lambda values: sum(values) / len(values) if values else 0.0  # noqa: E731
    forward = mean([e[3] - e[2] for e in events if e[0] == "F"])
    backward = mean([e[3] - e[2] for e in events if e[0] == "B"])
    step = max((e[3] for e in events), default=0.0) - min((e[2] for e in events), default=0.0)
    return forward, backward, step


def plot_timeline(timelines, title="", ax=None, unit=1e3, unit_name="ms", span=None):
    """One row per stage: forwards light, backwards dark, in the colour of their micro-batch; idle grey."""
    p = len(timelines)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.6 + 0.55 * p))
    events = [e for timeline in timelines for e in timeline]
    end = max((e[3] for e in events), default=1.0)
    span = span or end
    for s, timeline in enumerate(timelines):
        ax.barh(s, end * unit, left=0, height=0.8, color="#dddddd", hatch="///", edgecolor="#bbbbbb",
                linewidth=0)
        for kind, i, start, stop in timeline:
            width = max(stop - start, span * 1e-3) * unit
            colour = rank_colour(i)
            ax.barh(s, width, left=start * unit, height=0.8, color=colour, alpha=0.45 if kind == "F" else 1.0,
                    edgecolor="white", linewidth=0.6)
            if width > span * unit * 0.018:
                ax.text(start * unit + width / 2, s, f"{kind}{i}", ha="center", va="center", fontsize=7,
                        color="black" if kind == "F" else "white")
    ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
    ax.set_ylim(p - 0.4, -0.6)
    ax.set_xlim(0, span * unit * 1.01)
    ax.set_xlabel(f"{unit_name} since the first forward" if unit_name else "time")
    bubble = idle_fraction(timelines)
    ax.set_title(f"{title}{': ' if title else ''}idle (hatched) {bubble:.0%} of the step", fontsize=10)
    ax.spines[["top", "right"]].set_visible(False)
    return ax


def compare_timelines(named, unit=1e3, unit_name="ms"):
    """Several timelines (name -> per-stage events) one above the other, on the same time scale."""
    span = max((e[3] for timelines in named.values() for timeline in timelines for e in timeline),
               default=1.0)
    p = max(len(t) for t in named.values())
    fig, axes = plt.subplots(len(named), 1, figsize=(10, len(named) * (0.9 + 0.5 * p)), squeeze=False)
    for ax, (name, timelines) in zip(axes[:, 0], named.items(), strict=True):
        plot_timeline(timelines, title=name, ax=ax, unit=unit, unit_name=unit_name, span=span)
    fig.tight_layout()
    return fig


def timeline_slider(runs, unit=1e3, unit_name="ms"):
    """A slider over m: runs[m] is {name: per-stage events}, e.g. GPipe and 1F1B run with m micro-batches."""
    import ipywidgets as widgets
    from IPython.display import display

    values = sorted(runs)

    def draw(m):
        compare_timelines(runs[m], unit=unit, unit_name=unit_name)
        plt.show()

    slider = widgets.SelectionSlider(options=values, value=values[len(values) // 2], description="m",
                                     continuous_update=False)
    out = widgets.interactive_output(draw, {"m": slider})
    box = widgets.VBox([slider, out])
    display(box)
    return box
