"""Pictures of notebook 12: your ring of K/V blocks step by step, the causal work per rank, bytes.

    replay = RingAttentionReplay(runs, case)   # runs: run_attention_cases(ring_attention, 4, [case])[0]
    ring_explorer(runs, case)                # a slider over the steps
    plot_causal_work({"contiguous": runs_c, "balanced": runs_b}, cases)
    print_bytes_table(rows)

Why a module: the pictures must show what *your* code did. The replay reads the messages each
rank recorded (or, while graded, the grader's router saw): at every step, which rank's block each
rank holds -- its own first, then whatever the rank it receives from held one step before -- who
sent what to whom, and how many bytes. The block a rank computes with at a step, and the (query,
key) pairs that block needs under the causal mask, follow from the positions. The work per rank
is what torch's FlopCounterMode counted in your function.
"""

import torch

from dpcourse.topics.sequence.runs import case_positions
from dpcourse.viz import colours
from dpcourse.viz.widgets import explorer


class RingAttentionReplay:
    """The steps of a recorded ring: the block each rank holds at each step and the messages sent."""

    def __init__(self, runs, case):
        self.runs, self.case = runs, case
        self.n = len(runs)
        self.positions = case_positions(case, self.n)
        self.sends = [[o for o in run.ops if o.op == "send"] for run in runs]
        self.recvs = [[o for o in run.ops if o.op in ("recv", "recv_any_source")] for run in runs]
        self.steps = max((len(s) for s in self.sends), default=0) + 1
        self.held = [list(range(self.n))]  # held[step][rank]: whose block
        for step in range(self.steps - 1):
            now = self.held[-1]
            nxt = []
            for rank in range(self.n):
                recvs = self.recvs[rank]
                nxt.append(now[recvs[step].world_peer] if step < len(recvs) else None)
            self.held.append(nxt)

    def messages(self, step):
        """[(src, dst, nbytes)] of the sends of `step`."""
        return [(rank, sends[step].world_peer, sends[step].nbytes) for rank, sends in enumerate(self.sends)
                if step < len(sends)]

    def pairs(self, rank, block):
        """The (query, key) position pairs rank computes with `block`'s keys (the causal ones)."""
        q, k = self.positions[rank], self.positions[block]
        visible = k.view(1, -1) <= q.view(-1, 1) if self.case.get("causal") else torch.ones(len(q), len(k),
                                                                                           dtype=torch.bool)
        rows, cols = visible.nonzero(as_tuple=True)
        return q[rows], k[cols]

    def draw(self, step, axes=None):
        """Left: the ranks and the block each holds at `step`, arrows for the step's messages.
        Right: the whole score matrix, the pairs computed so far in each rank's colour."""
        import matplotlib.pyplot as plt

        if axes is None:
            _, axes = plt.subplots(1, 2, figsize=(12, 1.2 + 0.9 * max(self.n, 3)),
                                   gridspec_kw={"width_ratios": [1.3, 1]})
        left, right = axes
        seq = self.case["shape"][2]
        for rank in range(self.n):
            block = self.held[step][rank] if step < len(self.held) else None
            colours.draw_cell(left, 0, rank, [rank], f"rank {rank}", width=1.6)
            if block is not None:
                colours.draw_cell(left, 2.2, rank, [block], f"K/V {block}", width=1.6)
        for src, dst, nbytes in (self.messages(step) if step < self.steps - 1 else []):
            left.annotate("", xy=(4.3, dst + 0.4), xytext=(3.9, src + 0.4),
                          arrowprops=dict(arrowstyle="->", color=colours.rank_colour(src), lw=1.6,
                                          connectionstyle="arc3,rad=-0.4"))
            left.text(4.6, dst + 0.4, f"{nbytes} B from rank {src}", va="center", fontsize=8)
        for rank in range(self.n):
            done = sum(len(self.pairs(rank, self.held[s][rank])[0])
                       for s in range(min(step + 1, len(self.held))) if self.held[s][rank] is not None)
            left.text(-0.2, rank + 0.95, f"{done} score entries so far", fontsize=7, color="#555555")
        left.set_xlim(-0.3, 7.5)
        left.set_ylim(self.n + 0.1, -0.3)
        left.axis("off")
        left.set_title(f"step {step} of {self.steps - 1}: the K/V block each rank computes with"
                       + (", passed on (arrows)" if step < self.steps - 1 else " (the last)"), fontsize=9,
                       loc="left")
        grid = torch.full((seq, seq), -1.0)
        for s in range(min(step + 1, len(self.held))):
            for rank in range(self.n):
                block = self.held[s][rank]
                if block is None:
                    continue
                qs, ks = self.pairs(rank, block)
                grid[qs, ks] = rank
        image = torch.ones(seq, seq, 3)
        for rank in range(self.n):
            image[grid == rank] = torch.tensor(_rgb(colours.rank_colour(rank)))
        right.imshow(image.numpy(), interpolation="nearest")
        right.set_xlabel("key position")
        right.set_ylabel("query position")
        right.set_title("scores computed so far (colour: the query's rank)", fontsize=9)
        return axes


def _rgb(colour):
    from matplotlib.colors import to_rgb

    return to_rgb(colour)


def ring_explorer(runs, case, step=0):
    """A slider over the steps of your recorded ring (see RingAttentionReplay)."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    replay = RingAttentionReplay(runs, case)

    def draw(step):
        replay.draw(step)
        plt.show()

    slider = widgets.IntSlider(min=0, max=replay.steps - 1, value=step, description="step")
    return explorer({"step": slider}, draw, play="step")


def plot_causal_work(runs_by_split, title="causal ring attention: FLOPs each rank did (torch's "
                                          "FlopCounterMode)"):
    """Bars of the FLOPs per rank, one group of bars per split ({label: runs})."""
    import matplotlib.pyplot as plt

    _, ax = plt.subplots(figsize=(7, 3))
    labels = list(runs_by_split)
    n = len(next(iter(runs_by_split.values())))
    width = 0.8 / n
    for i, label in enumerate(labels):
        runs = runs_by_split[label]
        mean = sum(r.flops for r in runs) / n
        for rank, run in enumerate(runs):
            ax.bar(i + (rank - (n - 1) / 2) * width, run.flops / 1e3, width * 0.9,
                   color=colours.rank_colour(rank), label=f"rank {rank}" if i == 0 else None)
        ax.text(i, max(r.flops for r in runs) / 1e3 * 1.04, "max / mean = "
                                                            f"{max(r.flops for r in runs) / mean:.2f}",
                ha="center", fontsize=9)
    top = max(r.flops for runs in runs_by_split.values() for r in runs) / 1e3
    ax.set_ylim(0, top * 1.35)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("kFLOP")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, ncol=n, loc="upper right")
    plt.show()


def print_bytes_table(rows):
    """rows: [(method, N, measured bytes per rank, formula bytes)]."""
    print(f"{'method':<18} {'N':>3} {'measured, per rank':>19} {'formula':>10}")
    for method, n, measured, formula in rows:
        print(f"{method:<18} {n:>3} {measured:>19,.0f} {formula:>10,.0f}")
