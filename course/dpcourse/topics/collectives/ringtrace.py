"""Replay a learner's own ring, step by step, from what the recorder saw.

Used by notebook 04 (record_ring, ring_explorer).

    traces = record_ring(ring_all_reduce, 4, 6)   # run it on 4 ranks, 6 elements
    ring_explorer(traces)                         # a slider over the steps

Why a trace and not an animation: the picture must show what *your* code did, bugs
included. Each rank runs the function on a tensor holding 2**rank everywhere, inside a
recorder that, at every send and recv, notes which elements of the tensor the message
covers and snapshots the whole tensor (a few elements: cheap). Since every value is a sum
of distinct powers of two, each snapshot says exactly which ranks' contributions each
element holds (see maskpics): a complete all-reduce ends with every element = 2**N - 1.

A step is one send of a rank: rank r's k-th send is its step k (a ring does 2(N-1) of
them). The state drawn "before step k" is each rank's snapshot at its first call of step
k; a received message is matched to its send in order (messages between two ranks
arrive in the order they were sent), which tells where data that went through a separate
receive buffer came from.
"""

import torch
import torch.distributed as dist

from dpcourse.backend import rank_device
from dpcourse.comm.p2p import GROUP_TIMEOUT
from dpcourse.comm.recorder import CommRecorder
from dpcourse.reference.splits import chunk_bounds
from dpcourse.runtime.launcher import launch
from dpcourse.viz import colours as maskpics
from dpcourse.viz.widgets import explorer


class ChunkRecorder(CommRecorder):
    """A CommRecorder that also notes, for each send/recv, the elements of `watched` it covers
    (None if the message buffer is not a view of it) and a snapshot of `watched` before the call."""

    def __init__(self, watched, **kwargs):
        super().__init__(**kwargs)
        self.watched, self.p2p = watched, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        qualified = func.overloadpacket._qualified_op_name
        if qualified in ("c10d::send", "c10d::recv_"):
            tensor = args[0][0]
            self.p2p.append((self._span(tensor), self.watched.detach().clone().cpu()))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _span(self, tensor):
        base = self.watched
        if tensor.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
            return None
        start = (tensor.storage_offset() - base.storage_offset())
        return (start, start + tensor.numel())


def trace_ring(fn, length, *args, **kwargs):
    """Runs on every rank: fn(x, *args, **kwargs) on x = 2**rank (float64, `length` elements).

    Returns a dict the replay reads: rank, world size, the p2p events in program order
    (op, peer, nbytes, span, snapshot before the call) and the final tensor.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.full((length,), float(2 ** rank), dtype=torch.float64, device=rank_device())
    recorder = ChunkRecorder(x, p2p_only=True, exercise=getattr(fn, "__name__", "the function"))
    with recorder:
        fn(x, *args, **kwargs)
    p2p_ops = [o for o in recorder.ops if o.op in ("send", "recv")]
    events = [dict(op=o.op, peer=o.peer, nbytes=o.nbytes, span=span, before=snapshot)
              for o, (span, snapshot) in zip(p2p_ops, recorder.p2p, strict=False)]
    return dict(rank=rank, world=world, events=events, final=x.detach().cpu())


def record_ring(fn, world_size, length, *args, group_timeout=GROUP_TIMEOUT, **kwargs):
    """Launch world_size ranks that run trace_ring(fn, length, ...); a deadlock ends in seconds."""
    return launch(trace_ring, world_size, fn, length, *args, group_timeout=group_timeout, **kwargs)


class RingReplay:
    """The steps of a recorded ring: what each rank held before each step and what it sent."""

    def __init__(self, traces):
        self.traces = sorted(traces, key=lambda t: t["rank"])
        self.world = len(self.traces)
        self.length = self.traces[0]["final"].numel()
        self.chunks = chunk_bounds(self.length, self.world)
        self.sends = [[e for e in t["events"] if e["op"] == "send"] for t in self.traces]
        self.recvs = [[e for e in t["events"] if e["op"] == "recv"] for t in self.traces]
        self.steps = max((len(s) for s in self.sends), default=0)
        self._match()

    def _match(self):
        """Pair each send with the recv it fed: the m-th send r->p with the m-th recv on p from r."""
        for r, sends in enumerate(self.sends):
            count = {}
            for e in sends:
                m = count[e["peer"]] = count.get(e["peer"], -1) + 1
                p = e["peer"]
                from_r = [x for x in self.recvs[p] if x["peer"] == r] if 0 <= p < self.world else []
                e["matched"] = from_r[m] if m < len(from_r) else None

    def holds(self, step, rank):
        """Rank's tensor before `step` (0-based); the final tensor once step >= its steps."""
        sends, recvs = self.sends[rank], self.recvs[rank]
        events = self.traces[rank]["events"]
        firsts = [e for e in (sends[step] if step < len(sends) else None,
                              recvs[step] if step < len(recvs) else None) if e is not None]
        if not firsts:
            return self.traces[rank]["final"]
        return min(firsts, key=lambda e: next(i for i, x in enumerate(events) if x is e))["before"]

    def contributions(self, step, rank):
        """Per element: the list of ranks whose data it sums, or None if it is no valid sum."""
        return [maskpics.ranks_in(v, self.world) for v in self.holds(step, rank).tolist()]

    def messages(self, step):
        """The messages of a step: dicts src, dst, nbytes, span sent, span written on arrival."""
        out = []
        for r, sends in enumerate(self.sends):
            if step < len(sends):
                e = sends[step]
                arrival = e["matched"]["span"] if e.get("matched") and e["matched"]["span"] else None
                out.append(dict(src=r, dst=e["peer"], nbytes=e["nbytes"], span=e["span"],
                                arrives=arrival or e["span"]))
        return out

    def chunk_name(self, span):
        if span is None:
            return "a separate buffer"
        if span in self.chunks:
            return f"chunk {self.chunks.index(span)}"
        return f"elements {span[0]}–{span[1] - 1}"

    def complete(self):
        """True when every rank ends with every element holding every rank's contribution."""
        full = float(2 ** self.world - 1)
        return all(bool((t["final"] == full).all()) for t in self.traces)

    def _x(self, index):
        chunk = next((i for i, (a, b) in enumerate(self.chunks) if a <= index < b), 0)
        return index + 0.5 * chunk

    def draw(self, step, ax=None):
        """The ranks' tensors before `step`, the messages of that step as arrows, bytes so far."""
        import matplotlib.pyplot as plt

        n, length = self.world, self.length
        width = self._x(length - 1) + 1 if length else 1
        if ax is None:
            _, ax = plt.subplots(figsize=(3.5 + 0.55 * width, 0.9 + 0.6 * n))
        for rank in range(n):
            for i, who in enumerate(self.contributions(step, rank)):
                label = "all" if who is not None and len(who) == n and n > 1 else ""
                maskpics.draw_cell(ax, self._x(i), rank, who, label, fontsize=7)
            sent = sum(e["nbytes"] for e in self.sends[rank][:step])
            ax.text(width + 2.2, rank + 0.4, f"sent {sent} B in {min(step, len(self.sends[rank]))} "
                    f"message(s)", va="center", fontsize=8)
        for m in self.messages(step):
            if m["span"] is None:
                continue
            x0 = self._x(m["span"][1] - 1) + 0.92
            x1 = self._x(m["arrives"][1] - 1) + 0.92 if m["arrives"] else x0
            if not 0 <= m["dst"] < n:
                continue
            ax.add_patch(plt.Rectangle((self._x(m["span"][0]) - 0.05, m["src"] - 0.05),
                                       x0 - self._x(m["span"][0]) + 0.1, 0.9, fill=False,
                                       edgecolor="black", linewidth=2))
            ax.annotate("", xy=(x1 + 0.05, m["dst"] + 0.4), xytext=(x0 + 0.05, m["src"] + 0.4),
                        arrowprops=dict(arrowstyle="->", color=maskpics.rank_colour(m["src"]), lw=1.8,
                                        connectionstyle="arc3,rad=-0.5"))
        ax.set_xlim(-0.2, width + 6.5)
        maskpics.rank_axis(ax, n)
        for i, (a, b) in enumerate(self.chunks):
            if b > a:
                ax.text((self._x(a) + self._x(b - 1) + 0.92) / 2, -0.12, f"chunk {i}", ha="center",
                        fontsize=8, color="#555555")
        ax.set_title(self.caption(step), fontsize=9, loc="left")
        return ax

    def complete_chunks(self, rank):
        """The chunks whose every element, at the end on `rank`, sums all ranks' contributions."""
        final = self.traces[rank]["final"]
        full = float(2 ** self.world - 1)
        return [i for i, (a, b) in enumerate(self.chunks) if b > a and bool((final[a:b] == full).all())]

    def caption(self, step):
        if step >= self.steps:
            if self.complete():
                return f"after {self.steps} step(s): every element on every rank holds all ranks' data"
            held = "; ".join(f"rank {r}: {', '.join(map(str, self.complete_chunks(r))) or 'none'}"
                             for r in range(self.world))
            bad = sum(w is None for r in range(self.world) for w in self.contributions(step, r))
            return (f"after {self.steps} step(s), complete chunks -- {held}"
                    + (f"; {bad} element(s) are no sum of distinct ranks (black)" if bad else ""))
        parts = [f"{m['src']}→{m['dst']}: {self.chunk_name(m['span'])} ({m['nbytes']} B)"
                 for m in self.messages(step)]
        # the slider's value is the number of steps done: its title says the same number
        text = f"after {step} of {self.steps} steps; step {step + 1} sends " + ", ".join(parts)
        return text if len(text) < 140 else text[:137] + "…"


def ring_explorer(traces, step=0):
    """A slider over the steps of a recorded ring (see trace_ring)."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    replay = RingReplay(traces)

    def draw(step):
        replay.draw(step)
        plt.show()

    slider = widgets.IntSlider(min=0, max=replay.steps, value=step, description="steps done")
    return explorer({"step": slider}, draw)
