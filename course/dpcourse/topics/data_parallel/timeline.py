"""One nn.DataParallel-style iteration, timed phase by phase and stepped through with a slider.

Used by notebook 02 (record_iteration, phase_explorer).

`record_iteration(dp, loss_fn, x, y, optimizer)` runs one training step through
a DataParallel-like wrapper (the learner's MiniDataParallel, or nn.DataParallel)
and times what it can see from outside:
  * every replica's forward, from hooks on the wrapped module (they fire in the
    replica's thread, so each gets its own lane);
  * `dpcourse.topics.data_parallel.replicas.replicate`, which reports its own start and end;
  * scatter (from the call to replicate, or to the first replica's start), the
    launch of the threads (from replicate's end to the first replica's start),
    gather (from the last replica's end to the return), loss, backward, and
    the moment each parameter's gradient is complete (the reduce onto the
    original parameters), and the optimizer step.
`phase_explorer(timeline)` draws the lanes and walks through the phases, with
what each phase does on real GPUs and how many bytes it moves there.
"""

import time
from dataclasses import dataclass, field

import matplotlib.pyplot as plt

from dpcourse.topics.data_parallel import replicas as dp_replicas
from dpcourse.viz.timelines import Span, draw_timeline
from dpcourse.viz.widgets import explorer

PHASES = ("scatter", "replicate", "launch", "forward", "gather", "loss", "backward", "reduce", "step")


DESCRIPTIONS = {
    "scatter": "Device 0 cuts the batch into one piece per device and copies each piece to its device. "
               "On GPUs the whole batch sat on device 0 first: (N-1)/N of it leaves through device 0's link.",
    "replicate": "The module is copied to every device, parameters and buffers, at every forward pass "
                 "(torch.nn.parallel.replicate: a broadcast with autograd). On CPU devices the replicas "
                 "share the module, so nothing is copied; on 8 GPUs ResNet-50 sends 7 x 102 MB per step.",
    "launch": "The threads are created and started (and whatever the wrapper does between replicate and the "
              "first replica's forward). A device idles until its thread gets the GIL.",
    "forward": "One Python thread per device runs its replica on its piece. Kernels overlap; Python code "
               "between them takes turns holding the GIL.",
    "gather": "The outputs are copied to the output device (device 0) and concatenated in device order.",
    "loss": "The loss of the whole batch is computed on device 0 alone, while the other devices wait.",
    "backward": "Autograd runs back through gather, the replicas' forwards and scatter, each device on its "
                "own piece.",
    "reduce": "Each replica's gradients flow back through the broadcast and are summed into the original "
              "parameters on device 0 (one tick per parameter: the moment its gradient was complete).",
    "step": "The optimizer updates the parameters on device 0 only; the next forward copies them out again.",
}


COLOURS = dict(zip(PHASES, plt.get_cmap("tab10").colors, strict=False))


@dataclass
class Event:
    phase: str
    lane: str
    start: float
    end: float


@dataclass
class Timeline:
    events: list = field(default_factory=list)
    replicas: int = 0

    def duration(self, phase):
        """Seconds covered by a phase (forward: from the first replica's start to the last one's end)."""
        spans = [e for e in self.events if e.phase == phase]
        if not spans:
            return 0.0
        if phase == "forward":
            return max(e.end for e in spans) - min(e.start for e in spans)
        if phase == "reduce":
            return 0.0
        return sum(e.end - e.start for e in spans)

    def lanes(self):
        names = ["device 0 (caller)"]
        names += [f"replica {i}" for i in range(self.replicas)]
        return names


def record_iteration(dp, loss_fn, x, y, optimizer=None):
    """Run one step of training through `dp` (which wraps `dp.module`); return its Timeline."""
    inner = dp.module
    calls, replicate_spans = [], []

    def before(module, args):
        calls.append({"start": time.perf_counter(), "first_row": _first_row(args)})

    def after(module, args, output):
        now = time.perf_counter()
        for call in calls:
            if call.get("end") is None and call["first_row"] == _first_row(args):
                call["end"] = now
                break

    observe = lambda start, end: replicate_spans.append((start, end))  # noqa: E731 - tiny callback
    hooks = [inner.register_forward_pre_hook(before), inner.register_forward_hook(after)]
    grad_ticks = []
    grad_hooks = [p.register_post_accumulate_grad_hook(lambda _p: grad_ticks.append(time.perf_counter()))
                  for p in inner.parameters() if p.requires_grad]
    dp_replicas.observers.append(observe)
    try:
        if optimizer is not None:
            optimizer.zero_grad()
        t0 = time.perf_counter()
        output = dp(x)
        t1 = time.perf_counter()
        loss = loss_fn(output, y.to(output.device))
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        if optimizer is not None:
            optimizer.step()
        t4 = time.perf_counter()
    finally:
        dp_replicas.observers.remove(observe)
        for h in hooks + grad_hooks:
            h.remove()

    calls = [c for c in calls if c.get("end") is not None]
    calls.sort(key=lambda c: (c["first_row"] is None, c["first_row"]))
    timeline = Timeline(replicas=len(calls))
    main = "device 0 (caller)"
    first = min((c["start"] for c in calls), default=t1)
    last = max((c["end"] for c in calls), default=t1)
    rep = [(s, e) for s, e in replicate_spans if t0 <= s <= t1]
    if rep:
        s, e = rep[0]
        if s > t0:
            timeline.events.append(Event("scatter", main, t0, s))
        timeline.events.append(Event("replicate", main, s, e))
        if first > e:
            timeline.events.append(Event("launch", main, e, first))
    else:
        timeline.events.append(Event("scatter", main, t0, first))
    for i, c in enumerate(calls):
        timeline.events.append(Event("forward", f"replica {i}", c["start"], c["end"]))
    timeline.events.append(Event("gather", main, last, t1))
    timeline.events.append(Event("loss", main, t1, t2))
    timeline.events.append(Event("backward", main, t2, t3))
    for tick in grad_ticks:
        timeline.events.append(Event("reduce", main, tick, tick))
    if optimizer is not None:
        timeline.events.append(Event("step", main, t3, t4))
    for e in timeline.events:
        e.start, e.end = (e.start - t0) * 1e3, (e.end - t0) * 1e3  # milliseconds from the call
    return timeline


def _first_row(args):
    """Column 0 of the first row of the first tensor argument: identifies a replica's piece."""
    import torch

    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() >= 1 and len(a):
            return float(a.reshape(len(a), -1)[0, 0])
    return None


def plot_timeline(timeline, upto=None, ax=None):
    """Lanes of the iteration; phases after `upto` greyed out, the phase `upto` outlined."""
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.6 + 0.5 * (1 + timeline.replicas)))
    lanes = timeline.lanes()
    current = PHASES.index(upto) if upto in PHASES else len(PHASES)
    end = max(e.end for e in timeline.events)
    spans, ticks = [], []
    for e in timeline.events:
        row = lanes.index(e.lane) if e.lane in lanes else 0
        order = PHASES.index(e.phase)
        colour = COLOURS[e.phase] if order <= current else (0.85, 0.85, 0.85)
        if e.phase == "reduce":  # an instant: the moment a parameter's gradient was complete
            ticks.append((row, e.start, colour))
        else:
            spans.append(Span(row, e.start, e.end, colour, edge="black" if order == current else None))
    draw_timeline(ax, [lanes], spans, ticks, xlabel="milliseconds since the call", height=0.6,
                  min_width=end * 0.004)
    for phase in PHASES:
        if any(e.phase == phase for e in timeline.events):
            ax.bar(0, 0, color=COLOURS[phase], label=phase)
    ax.legend(ncol=len(PHASES), fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    return ax


def describe_phase(timeline, phase, traffic=None):
    """One paragraph: what the phase does, how long it took here, and bytes on real GPUs if given."""
    text = f"{phase}: {DESCRIPTIONS[phase]}"
    if phase == "reduce":
        ticks = sum(1 for e in timeline.events if e.phase == "reduce")
        text += f" Here: {ticks} parameters."
    else:
        text += f" Here: {timeline.duration(phase):.2f} ms."
    if traffic and phase in traffic:
        text += f" On GPUs: {traffic[phase] / 1e6:,.1f} MB through device 0."
    return text


def phase_explorer(timeline, traffic=None):
    """A slider (and a play button) over the phases of the iteration: the timeline so far and what
    the phase does.

    traffic: optional {phase: bytes through device 0 on real GPUs} (see topics.data_parallel.costs).
    """
    import ipywidgets as widgets

    phases = [p for p in PHASES if any(e.phase == p for e in timeline.events)]

    def draw(k):
        phase = phases[k]
        plot_timeline(timeline, upto=phase)
        plt.show()
        print(f"step {k + 1}/{len(phases)} -- {describe_phase(timeline, phase, traffic)}")

    return explorer({"k": widgets.IntSlider(value=0, min=0, max=len(phases) - 1, description="phase")}, draw,
                    play="k")
