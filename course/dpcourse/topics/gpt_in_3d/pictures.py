"""Notebook 13's pictures, drawn from the learner's own runs: the mesh with the bytes each group moved, one
step's timeline per rank, every layout's loss curve over one process's.

    draw_mesh((2, 2, 2), report_of_rank)          # three panels: the dp, pp and tp groups, bytes per step
    draw_step(reports, (2, 2, 2), "step 1")        # one row per rank: its calls on each group, over time
    draw_losses({"(2, 2, 2)": [...], ...}, reference_losses)

Used by notebook 13's demo cells. The bytes are the ones the ranks' calls put on the network, each priced as
a ring sends it (comm.volume.ring_bytes), summed per group from the records of the step (checks.
bytes_per_group), never assumed from a formula.
"""

import matplotlib.pyplot as plt

from dpcourse.comm.volume import ring_bytes
from dpcourse.topics.gpt_in_3d.checks import expected_mesh
from dpcourse.topics.gpt_in_3d.runs import AXES, coordinates, phase_ops
from dpcourse.viz.timelines import Span, draw_timeline

AXIS_COLOURS = {"dp": plt.get_cmap("Blues"), "pp": plt.get_cmap("Greens"), "tp": plt.get_cmap("Oranges")}
KIND_COLOURS = {"dp": "#4c72b0", "pp": "#55a868", "tp": "#dd8452", "other": "#8c8c8c"}


def axis_of(group, layout, rank):
    """Which mesh dim a group (world ranks) is, seen from `rank`: "dp", "pp", "tp" or "other"."""
    members = expected_mesh(layout)[rank]["members"]
    for axis in AXES:
        if list(group) == members[axis]:
            return axis
    return "other"


def group_bytes(reports, layout, labels):
    """{(axis, group): bytes one member sent in the phases `labels`} over every rank (each group once, the
    largest of its members' counts)."""
    out = {}
    for rank, report in enumerate(reports):
        for label in labels:
            for op in phase_ops(report, label):
                try:
                    sent = ring_bytes(op)
                except ValueError:
                    continue
                key = (axis_of(op.group or (), layout, rank), tuple(op.group or ()))
                out.setdefault(key, {}).setdefault(rank, 0.0)
                out[key][rank] += sent
    return {key: max(per_rank.values()) for key, per_rank in out.items()}


def draw_mesh(layout, reports=None, labels=(), title=None):
    """The world's ranks as a dp x (pp x tp) grid, three times: coloured by dp, by pp and by tp group;
    with `reports` (one per rank) each group is labelled with the bytes one of its members sent."""
    dp, pp, tp = layout
    sent = group_bytes(reports, layout, labels) if reports is not None else {}
    fig, axes = plt.subplots(1, 3, figsize=(12, 0.9 + 0.75 * dp))
    for ax, axis in zip(axes, AXES, strict=True):
        groups = sorted({tuple(m["members"][axis]) for m in expected_mesh(layout)})
        for rank in range(dp * pp * tp):
            c = coordinates(layout, rank)
            group = tuple(expected_mesh(layout)[rank]["members"][axis])
            shade = AXIS_COLOURS[axis](0.35 + 0.55 * groups.index(group) / max(1, len(groups) - 1))
            x, y = c["pp"] * (tp + 0.4) + c["tp"], c["dp"]
            ax.add_patch(plt.Rectangle((x, y), 0.9, 0.8, color=shade))
            ax.text(x + 0.45, y + 0.4, f"rank {rank}", ha="center", va="center", fontsize=8, color="white",
                    fontweight="bold")
        ax.set_xlim(-0.2, pp * (tp + 0.4))
        ax.set_ylim(dp, -0.3)
        ax.axis("off")
        lines = [f"{axis} groups: {len(groups)} of {len(groups[0])}"]
        for group in groups:
            if (axis, group) in sent:
                lines.append(f"{list(group)}: {sent[(axis, group)] / 1e3:,.1f} kB")
        ax.set_title("\n".join(lines[:5]) + ("\n..." if len(lines) > 5 else ""), fontsize=8)
    fig.suptitle(title or f"{dp * pp * tp} ranks as a (dp, pp, tp) = {layout} mesh", fontsize=10)
    plt.tight_layout()
    plt.show()


def draw_step(reports, layout, label, title=None):
    """One row per rank: the calls it made in phase `label`, coloured by the mesh dim of their group, from the
    start of the phase (the first call of any rank) to its end; white is computing (or waiting for a
    message: a recv bar that lasts is a pipeline bubble)."""
    spans, start, end = [], None, None
    for report in reports:
        for op in phase_ops(report, label):
            start = op.start if start is None else min(start, op.start)
            end = op.end if end is None else max(end, op.end)
    fig, ax = plt.subplots(figsize=(11, 0.6 + 0.42 * len(reports)))
    for rank, report in enumerate(reports):
        for op in phase_ops(report, label):
            axis = axis_of(op.group or (), layout, rank)
            spans.append(Span(rank, (op.start - start) * 1e3, (op.end - start) * 1e3, KIND_COLOURS[axis]))
    c = [coordinates(layout, r) for r in range(len(reports))]
    draw_timeline(ax, [[f"rank {r} (pp {c[r]['pp']}, tp {c[r]['tp']})" for r in range(len(reports))]], spans,
                  xlabel="milliseconds since the step's first call", min_width=0.15)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour) for colour in KIND_COLOURS.values()]
    ax.legend(handles, [f"{k} group" for k in KIND_COLOURS], loc="upper left", bbox_to_anchor=(1.0, 1.0),
              fontsize=8, frameon=False)
    ax.set_title(title or f"{label} of layout {layout}: every communication call, per rank", fontsize=10)
    plt.tight_layout()
    plt.show()


def draw_losses(curves, reference, title="every layout's loss, step by step, over one process's"):
    """curves: {label: [loss per step]}; reference: one process's losses. The layouts' lines lie on the
    reference's (a difference shows in the right panel, in units of 1e-6)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 3.6))
    steps = range(len(reference))
    left.plot(steps, reference, color="black", lw=4, alpha=0.3, label="one process (float64)")
    for label, losses in curves.items():
        left.plot(range(len(losses)), losses, marker="o", markersize=3, lw=1, label=label)
        right.plot(range(len(losses)), [(a - b) * 1e6 for a, b in zip(losses, reference, strict=False)],
                   marker="o", markersize=3, lw=1, label=label)
    left.set_xlabel("step")
    left.set_ylabel("loss")
    left.legend(fontsize=8)
    right.set_xlabel("step")
    right.set_ylabel("layout − one process (× 1e-6)")
    right.axhline(0, color="black", lw=0.5)
    fig.suptitle(title, fontsize=10)
    plt.tight_layout()
    plt.show()
