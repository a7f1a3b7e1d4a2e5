"""Notebook 14's pictures: the time a checkpoint interval wastes, and each rank's step times.

Used by notebook 14's demo cells (nothing here is graded).
"""

import matplotlib.pyplot as plt

from dpcourse.topics.when_ranks_fail.costs import simulate_waste, waste_fraction, young_interval
from dpcourse.viz.colours import rank_colour


def plot_waste(intervals, checkpoint_seconds, mtbf_seconds, restart_seconds=0.0, measured=None, unit="steps",
               step_seconds=1.0):
    """Wasted fraction against the interval: first order (line), simulated failures (dots), Young's optimum
    (dashed), and `measured` [(interval, lost steps)] of real runs on a second axis. Intervals in `unit`s of
    `step_seconds` each."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.6))
    seconds = [i * step_seconds for i in intervals]
    first_order = [waste_fraction(s, checkpoint_seconds, mtbf_seconds, restart_seconds) for s in seconds]
    left.plot(intervals, first_order, label="δ/τ + (τ/2 + R)/M")
    left.plot(intervals, [simulate_waste(s, checkpoint_seconds, mtbf_seconds, restart_seconds, trials=60)
                          for s in seconds], "o", label="failures simulated")
    best = young_interval(checkpoint_seconds, mtbf_seconds) / step_seconds
    left.axvline(best, linestyle="--", color="grey", label=f"Young: √(2δM) = {best:.0f} {unit}")
    left.set(xscale="log", xlabel=f"checkpoint interval τ ({unit})", ylabel="fraction of time wasted",
             title="what an interval costs")
    left.legend(fontsize=8)
    if measured:
        xs, lost = zip(*measured, strict=True)
        right.plot(xs, lost, "o", label="your runs: steps lost to the kill")
        right.plot(sorted(set(xs)), [x / 2 for x in sorted(set(xs))], "-", label="τ / 2 (a kill at a "
                                                                                 "random step)")
        right.plot(sorted(set(xs)), [x - 1 for x in sorted(set(xs))], ":", label="τ − 1 (the worst case)")
        right.set(xlabel=f"checkpoint interval ({unit})", ylabel="steps recomputed", title="lost work, "
                                                                                           "measured")
        right.legend(fontsize=8)
    else:
        right.axis("off")
    plt.tight_layout()
    plt.show()


def plot_step_times(compute, slowest=None):
    """Each rank's compute time per step (a bar per rank and step), and the synchronous step (the max)."""
    ranks, steps = len(compute), len(compute[0])
    fig, ax = plt.subplots(figsize=(9, 3))
    width = 0.8 / ranks
    for rank, times in enumerate(compute):
        ax.bar([s + rank * width for s in range(steps)], [t * 1e3 for t in times], width,
               color=rank_colour(rank), label=f"rank {rank}" + (" (slowest)" if rank == slowest else ""))
    centres = [s + 0.4 - width / 2 for s in range(steps)]
    ax.plot(centres, [max(c[s] for c in compute) * 1e3 for s in range(steps)], "k_", markersize=30,
            label="the step (everyone waits for the slowest)")
    ax.set(xlabel="step", ylabel="compute (ms)", xticks=centres,
           xticklabels=list(range(steps)))
    ax.legend(fontsize=8)
    plt.tight_layout()
    plt.show()
