"""Pictures of notebook 09: a grid of ranks with each group highlighted, and the planner widget.

    reports = run_grid_cases(make_grid_groups, 8, [dict(dp=2, tp=2, pp=2)])[0]
    draw_grid(reports, title="your make_grid_groups(2, 2, pp=2)")
    planner_widget(plan)      # sliders: model size, nodes, GPUs per node, links, memory -> time and memory

Why: a grid is easiest to check by eye. `draw_grid` places every rank where *its own*
coordinates say (pp blocks side by side, dp down, tp across) and paints it, once per axis, in
the colour of the group the learner's code put it in; a layout with two axes swapped shows
up as stripes running the wrong way. The widget puts the cost model of `costs` behind
sliders: the predicted step time (split into compute, bubble, tp, pp and dp) and the memory
per GPU of pure data parallelism, ZeRO-3, pure tensor and pure pipeline parallelism, and of
the hybrid layout the learner's `plan` picks (and, with "overlap" ticked, the fastest layout
under that assumption, which `plan` cannot see). Used by notebook 09.
"""

import matplotlib.pyplot as plt

from dpcourse.topics.hybrid.costs import MODELS, fastest, format_layout, predict
from dpcourse.topics.hybrid.grid import AXES
from dpcourse.toys.clusters import cluster, gpus
from dpcourse.viz.colours import rank_colour

AXIS_NAMES = {"dp": "data-parallel groups (dp)", "pp": "pipeline groups (pp)", "tp": "tensor-parallel "
                                                                                     "groups (tp)"}


def draw_grid(reports, title=""):
    """One panel per axis; each rank at its own (dp, pp, tp) coordinates, coloured by its group there."""
    sizes = reports[0]["sizes"]
    dp, pp, tp = (sizes[a] for a in AXES)
    fig, axes = plt.subplots(1, 3, figsize=(3.2 * 3, 0.9 + 0.75 * dp), squeeze=False)
    for ax, axis in zip(axes[0], AXES, strict=True):
        groups = sorted({tuple(sorted(r["members"][axis])) for r in reports
                         if isinstance(r["members"][axis], list)})
        for rank, report in enumerate(reports):
            d, p, t = (report["coords"][a] for a in AXES)
            x, y = p * (tp + 0.5) + t, dp - 1 - d
            members = report["members"][axis]
            colour = (rank_colour(groups.index(tuple(sorted(members)))) if isinstance(members, list)
                      else "#222222")
            ax.add_patch(plt.Rectangle((x, y), 0.9, 0.8, color=colour))
            ax.text(x + 0.45, y + 0.4, str(rank), ha="center", va="center", color="white", fontsize=11,
                    fontweight="bold")
        ax.set_xlim(-0.2, pp * (tp + 0.5))
        ax.set_ylim(-0.2, dp)
        ax.set_xticks([p * (tp + 0.5) + t + 0.45 for p in range(pp) for t in range(tp)],
                      [f"p{p} t{t}" if pp > 1 else f"t{t}" for p in range(pp) for t in range(tp)], fontsize=8)
        ax.set_yticks([dp - 1 - d + 0.4 for d in range(dp)], [f"d{d}" for d in range(dp)], fontsize=8)
        ax.set_title(f"{AXIS_NAMES[axis]}: {len(groups)} of {len(reports) // len(groups)}", fontsize=9)
        ax.spines[["top", "right", "left", "bottom"]].set_visible(False)
        ax.tick_params(length=0)
    fig.suptitle(title or f"dp {dp} x pp {pp} x tp {tp}: each rank at its coordinates, one colour per group",
                 fontsize=10)
    fig.tight_layout()
    return fig


PARTS = ("compute", "bubble", "tp_comm", "pp_comm", "dp_comm")
PART_COLOURS = {"compute": "#4c72b0", "bubble": "#bbbbbb", "tp_comm": "#dd8452", "pp_comm": "#55a868",
                "dp_comm": "#c44e52"}


def _best_micro(model, cl, dp, tp, pp, zero=0, overlap=False):
    """The fastest micro-batch count of one layout that fits in memory (else the smallest memory);
    why the layout is impossible, when no micro-batch count makes it one."""
    options, why = [], "no micro-batch count fits"
    for micro in range(1, model["batch"] // dp + 1):
        try:
            options.append((predict(model, cl, dp, tp, pp, micro, zero=zero, overlap=overlap), micro))
        except ValueError as error:
            why = str(error)
            continue
    if not options:
        return why
    fits = [o for o in options if o[0]["memory"] <= cl["memory"]]
    chosen = min(fits, key=lambda o: o[0]["time"]) if fits else min(options, key=lambda o: o[0]["memory"])
    return dict(chosen[0], dp=dp, tp=tp, pp=pp, micro=chosen[1])


def strategies(model, cl, plan=None, overlap=False):
    """{name: prediction} for pure DP, ZeRO-3, pure TP, pure PP and plan's hybrid layout (when given).

    plan(model, cluster) chooses without overlap (the exercise's cost model); with overlap=True its
    layout is timed with overlap, and one more row gives the fastest layout under that assumption
    (every layout tried), so the widget shows whether the choice would change."""
    n = gpus(cl)
    rows = {"DP": _best_micro(model, cl, n, 1, 1, overlap=overlap),
            "ZeRO-3": _best_micro(model, cl, n, 1, 1, zero=3, overlap=overlap),
            "TP": _best_micro(model, cl, 1, n, 1, overlap=overlap),
            "PP": (_best_micro(model, cl, 1, 1, n, overlap=overlap) if model["layers"] % n == 0 else
                   f"{n} stages of {model['layers']} layers: no whole layers per stage")}
    if plan is not None:
        try:
            chosen = plan(model, cl)
            rows["hybrid (your plan)"] = dict(predict(model, cl, chosen["dp"], chosen["tp"], chosen["pp"],
                                                      chosen["micro"], overlap=overlap),
                                              **{k: chosen[k] for k in ("dp", "tp", "pp", "micro")})
        except NotImplementedError:
            rows["hybrid (your plan)"] = "plan is not written yet"
        except ValueError as error:
            rows["hybrid (your plan)"] = f"ValueError: {error}"
    if overlap:
        best = fastest(model, cl, overlap=True)
        rows["fastest with overlap (every layout)"] = best if best is not None else "no layout fits"
    return rows


def plot_strategies(rows, cl, title=""):
    """Stacked bars of the predicted step time, and bars of memory per GPU against the GPU's memory."""
    names = list(rows)
    times = [r["time"] for r in rows.values() if isinstance(r, dict)]
    # a layout 100x slower than the others would hide them: cut its bar
    limit = min(max(times), 4 * min(times)) * 1.15 if times else 1.0
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 0.6 + 0.45 * len(names)), sharey=True)
    for i, name in enumerate(names):
        row = rows[name]
        if not isinstance(row, dict):
            left.text(0, i, f"  {row}"[:90], va="center", fontsize=8)
            continue
        start = 0.0
        for part in PARTS:
            left.barh(i, row[part], left=start, color=PART_COLOURS[part],
                      label=part.replace("_comm", " comm.") if i == 0 else None)
            start += row[part]
        left.text(min(start, limit), i, f" {row['time']:.3g} s" + (" (bar cut)" if start > limit else ""),
                  va="center", fontsize=8)
        fits = row["memory"] <= cl["memory"]
        right.barh(i, row["memory"] / 1e9, color="#4c72b0" if fits else "#c44e52")
        right.text(row["memory"] / 1e9, i, f" {row['memory'] / 1e9:.3g} GB  ({format_layout(row)})",
                   va="center",
                   fontsize=7)
    left.set_xlim(0, limit * 1.25)
    left.set_yticks(range(len(names)), names)
    left.invert_yaxis()
    left.set_xlabel("predicted seconds per step")
    left.legend(fontsize=7, frameon=False, ncol=5, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    right.axvline(cl["memory"] / 1e9, color="black", linestyle="--", linewidth=1)
    right.set_xlabel(f"memory per GPU (GB); dashed: the GPU's {cl['memory'] / 1e9:g} GB, red: does not fit")
    for ax in (left, right):
        ax.spines[["top", "right"]].set_visible(False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def planner_widget(plan=None):
    """Sliders over the model and the cluster; the strategies' predicted time and memory, redrawn."""
    import ipywidgets as widgets
    from IPython.display import display

    controls = dict(
        model=widgets.SelectionSlider(options=list(MODELS), value="GPT 7B", description="model size"),
        nodes=widgets.SelectionSlider(options=[1, 2, 4, 8, 16, 32, 64, 128], value=32, description="nodes"),
        gpus_per_node=widgets.SelectionSlider(options=[1, 2, 4, 8, 16], value=8, description="GPUs/node"),
        intra=widgets.FloatLogSlider(value=300, base=10, min=1, max=3.3, description="NVLink GB/s"),
        inter=widgets.FloatLogSlider(value=25, base=10, min=0, max=2.7, description="network GB/s"),
        memory=widgets.SelectionSlider(options=[16, 24, 32, 40, 48, 80, 141], value=80, description="GB/GPU"),
        overlap=widgets.Checkbox(value=False, description="overlap dp with backward"),
    )

    def draw(model, nodes, gpus_per_node, intra, inter, memory, overlap):
        cl = cluster(nodes=nodes, gpus_per_node=gpus_per_node, memory=memory * 1e9,
                     intra_bandwidth=intra * 1e9,
                     inter_bandwidth=inter * 1e9)
        rows = strategies(MODELS[model], cl, plan, overlap=overlap)
        plot_strategies(rows, cl, title=f"{model} on {nodes} x {gpus_per_node} GPUs")
        plt.show()

    out = widgets.interactive_output(draw, controls)
    boxes = list(controls.values())
    display(widgets.VBox([widgets.HBox(boxes[:4]), widgets.HBox(boxes[4:]), out]))
    # nothing returned: a returned widget, last in its cell, would be displayed a second time
