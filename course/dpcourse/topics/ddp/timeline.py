"""A timeline of one training step as a rank lived it: backward compute per layer, all-reduce per bucket.

Used by notebook 05 (record_timelines, timeline_explorer).

Why: "communication overlaps with backward" is a claim about time, and the way to
believe it is to see your own step drawn to scale. `record_step` runs one step of
a DDP wrapper under a `StepTimeline` -- a `CommRecorder` (every c10d call, with its
issue time) that also notes when each parameter's gradient was computed and when
each collective *completed* -- and `plot_timeline` draws it:

    backward   |head|fc11|fc10|fc9 |...|fc0|               compute, one segment per layer
    all-reduce      [bucket 0 ]  [bucket 1  ]   [bucket 2]  issue -> completion, per bucket
                                             ^ backward ends   ^ gradients synchronised

Everything right of "backward ends" is communication the step waits for
(exposed); everything left of it was hidden behind compute. `timeline_explorer`
puts a bucket-size slider on timelines recorded for several bucket caps.

Notes: hooks and the recorder must live in the thread that runs backward; on the
CPU autograd runs parameter hooks in the thread that called backward(). On a GPU
the times are when the CPU issued the work, not when the GPU ran it.
"""

import time

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

from dpcourse.backend import rank_device
from dpcourse.comm.recorder import CommRecorder
from dpcourse.toys.data import my_share, smooth_regression_data
from dpcourse.toys.models import deep_mlp, loss_fn
from dpcourse.viz.tables import format_bytes
from dpcourse.viz.timelines import Span, draw_timeline
from dpcourse.viz.widgets import explorer


def _work_in(value):
    """The c10d Work object an operator returned (alone or inside a tuple), or None."""
    if isinstance(value, torch.ScriptObject):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _work_in(item)
            if found is not None:
                return found
    return None


class StepTimeline(CommRecorder):
    """A CommRecorder that also records gradient times per parameter and completion times per collective.

    `model` is the plain module (not the DDP wrapper) whose parameters to watch.
    Use it as a context manager around one step, and call `mark(name)` at the
    moments you want on the picture ("backward_start", "backward_end", "synced").
    """

    def __init__(self, model):
        super().__init__()
        self.names = {p: name for name, p in model.named_parameters() if p.requires_grad}
        self.grad_times = {}  # parameter name -> time its gradient was computed (last time)
        self.done = {}  # index in self.ops -> completion time
        self.marks = {}
        self._handles = [p.register_hook(self._stamp(name)) for p, name in self.names.items()]

    def _stamp(self, name):
        def hook(grad):
            self.grad_times[name] = time.perf_counter()
        return hook

    def mark(self, name):
        self.marks[name] = time.perf_counter()

    def remove_hooks(self):
        for handle in self._handles:
            handle.remove()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = len(self.ops)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        work = _work_in(out) if len(self.ops) > before else None
        if work is not None:
            index = before
            try:
                future = dist.distributed_c10d.Work.unbox(work).get_future()
                future.then(lambda _, index=index: self.done.__setitem__(index, time.perf_counter()))
            except Exception:  # noqa: BLE001 - no completion time: the bar ends where the call returned
                pass
        return out

    def summary(self):
        """A picklable dict of times relative to the start of backward (seconds)."""
        t0 = self.marks.get("backward_start", min(self.grad_times.values(), default=0.0))
        layers = {}
        for name, t in self.grad_times.items():
            layer = name.rsplit(".", 1)[0] if "." in name else name
            layers[layer] = max(layers.get(layer, t), t)
        order = sorted(layers.items(), key=lambda item: item[1])
        compute, previous = [], 0.0
        for layer, t in order:
            compute.append((layer, previous, t - t0))
            previous = t - t0
        comms = [(op.op, op.nbytes, op.start - t0, self.done.get(i, op.end) - t0)
                 for i, op in enumerate(self.ops) if op.op != "barrier"]
        return {"compute": compute, "comms": comms,
                "marks": {name: t - t0 for name, t in self.marks.items()}}


def record_step(ddp_model, module, x, y, sync=None):
    """Run one training step (forward, backward, sync) under a StepTimeline; return its summary.

    `sync` is called after backward (e.g. `ddp_model.finish_gradient_sync`); None for
    wrappers that finish inside backward, like torch's DistributedDataParallel.
    """
    timeline = StepTimeline(module)
    try:
        with timeline:
            loss = loss_fn(ddp_model(x), y)
            timeline.mark("backward_start")
            loss.backward()
            timeline.mark("backward_end")
            if sync is not None:
                sync()
            timeline.mark("synced")
    finally:
        timeline.remove_hooks()
    for p in module.parameters():
        p.grad = None
    return timeline.summary()


def record_timelines(wrapper, caps, depth=12, width=128, per_rank=64, warmup=1, repeats=3,
                     dtype=torch.float32):
    """On each rank: for each bucket cap, wrap a fresh deep MLP with `wrapper(module, bucket_cap=cap)`,
    run `warmup` steps, record `repeats` steps and keep the typical one (rank 0's median step time:
    on a shared machine a single step can be preempted). Returns [summary for each cap]. Launch it:

        per_rank = launch(record_timelines, 2, BucketedDDP, [4096, 65536])
    """
    X, Y = smooth_regression_data(per_rank * dist.get_world_size(), features=width, outputs=width, seed=1,
                                  dtype=dtype)
    x, y = my_share(X, Y, 0, per_rank)
    summaries = []
    for cap in caps:
        module = deep_mlp(depth, width, d_in=width, d_out=width, seed=0, dtype=dtype, device=rank_device())
        ddp = wrapper(module, bucket_cap=cap)
        sync = getattr(ddp, "finish_gradient_sync", None)
        for _ in range(warmup):
            loss_fn(ddp(x), y).backward()
            if sync is not None:
                sync()
            for p in module.parameters():
                p.grad = None
        recorded = []
        for _ in range(repeats):
            dist.barrier()
            recorded.append(record_step(ddp, module, x, y, sync))
        order = sorted(range(repeats), key=lambda i: recorded[i]["marks"]["synced"])
        typical = torch.tensor([order[repeats // 2]])
        dist.broadcast(typical, src=0)  # every rank shows the same step
        summaries.append(recorded[int(typical)])
    return summaries


def exposed_communication(summary):
    """Seconds the step waited for communication after backward ended."""
    marks = summary["marks"]
    return max(0.0, marks.get("synced", 0.0) - marks.get("backward_end", 0.0))


def waiting_and_copying(summary):
    """(seconds waiting for collectives after backward, seconds copying results back after the last
    one completed): the two parts of the time between backward's end and "gradients synchronised"."""
    marks = summary["marks"]
    if "backward_end" not in marks or "synced" not in marks:
        return 0.0, 0.0
    end, synced = marks["backward_end"], marks["synced"]
    last_done = max([end, *(c[3] for c in summary["comms"])])
    last_done = min(last_done, synced)
    return last_done - end, synced - last_done


def plot_timeline(summaries, title="", ax=None):
    """Draw one step per rank: backward compute per layer, then each collective from issue to completion.

    `summaries` is one summary (a dict from `record_step`) or a list, one per rank.
    """
    if isinstance(summaries, dict):
        summaries = [summaries]
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 0.9 + 1.2 * len(summaries)))
    colours = plt.get_cmap("tab20")
    ms = 1e3
    end = max(max([*s["marks"].values(), *(c[3] for c in s["comms"]), *(c[2] for c in s["compute"])])
              for s in summaries) * ms or 1.0
    groups, spans = [], []
    for rank, s in enumerate(summaries):
        groups.append([f"rank {rank} backward", f"rank {rank} all-reduce"])
        for i, (layer, start, stop) in enumerate(s["compute"]):
            label = layer if (stop - start) * ms > 0.05 * end else ""
            spans.append(Span(2 * rank, start * ms, stop * ms, colours(2 * (i % 10) + 1), label, edge="white",
                              linewidth=0.5))
        for i, (op, nbytes, start, stop) in enumerate(s["comms"]):
            width = max(stop - start, 1e-6) * ms
            label = f"{op} {format_bytes(nbytes)}" if width > 0.08 * end else ""
            spans.append(Span(2 * rank + 1, start * ms, start * ms + width, colours(2 * (i % 10)), label,
                              edge="black", text_colour="white", linewidth=0.5))
    ys = draw_timeline(ax, groups, spans, xlabel="milliseconds since backward started   (dashed: backward "
                       "ends; red: waiting for all-reduces; blue: copying the results back into .grad)")
    for rank, s in enumerate(summaries):
        marks, y_compute, y_comm = s["marks"], ys[2 * rank], ys[2 * rank + 1]
        if "backward_end" in marks:
            x = marks["backward_end"] * ms
            ax.plot([x, x], [y_compute - 0.5, y_comm + 0.5], color="black", linestyle="--", linewidth=1)
            if "synced" in marks:
                waiting, copying = waiting_and_copying(s)
                height = y_comm - y_compute + 1.0
                ax.add_patch(plt.Rectangle((x, y_compute - 0.5), waiting * ms, height, color="red",
                                           alpha=0.12, linewidth=0))
                ax.add_patch(plt.Rectangle((x + waiting * ms, y_compute - 0.5), copying * ms, height,
                                           color="tab:blue", alpha=0.15, linewidth=0))
    ax.set_xlim(0, end * 1.02)
    waiting, copying = (1e3 * t for t in waiting_and_copying(summaries[0]))
    n_comms = len(summaries[0]["comms"])
    ax.set_title(title or f"{n_comms} collectives; after backward rank 0 waited {waiting:.2f} ms for them "
                          f"and copied results back for {copying:.2f} ms")
    return ax


def timeline_explorer(per_rank_summaries, caps):
    """A bucket-size slider over timelines recorded for each cap (the result of `record_timelines`).

    `per_rank_summaries[r][i]` is rank r's step recorded with bucket cap `caps[i]`.
    """
    import ipywidgets as widgets

    options = [(format_bytes(cap), i) for i, cap in enumerate(caps)]

    def draw(index):
        summaries = [rank_summaries[index] for rank_summaries in per_rank_summaries]
        fig, ax = plt.subplots(figsize=(11, 0.9 + 1.2 * len(summaries)))
        n = len(summaries[0]["comms"])
        exposed = exposed_communication(summaries[0]) * 1e3
        plot_timeline(summaries, ax=ax, title=f"bucket_cap = {format_bytes(caps[index])}: {n} all-reduces; "
                                              f"rank 0 waited {exposed:.2f} ms after backward")
        fig.tight_layout()
        plt.show()

    slider = widgets.SelectionSlider(options=options, value=len(caps) // 2, description="bucket_cap",
                                     continuous_update=False)
    return explorer({"index": slider}, draw)
