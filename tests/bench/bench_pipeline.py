"""1F1B step time: the reference 1F1B executor vs torch.distributed.pipelining's Schedule1F1B, and the bubble.

Part 1, speed. Same model (an MLP of 8 Linear(512, 512) + Tanh layers, float32: 2.1 M
parameters), same batch (256 rows in m = 8 micro-batches of 32), cut into p = 2 and p = 4
equal stages, stage s on rank s (gloo on the CPU, NCCL with one GPU per rank). The reference
executor (autograder/dpgrader/pipeline_parallelism/tuned.py) and torch's Schedule1F1B and ScheduleGPipe
(built once per rank) run interleaved in one launch (round-robin, order rotated every round,
a barrier before and after each step), 3 steps per variant and round, after a warm-up step.
The ratio to Schedule1F1B is the median over rounds of per-round median ratios (pairing each
round with itself cancels the drift of a shared machine). Target: <= 1.1x.

Part 2, the bubble. A model whose Linear layers sleep 10 ms forward and 20 ms backward (a
stand-in for big layers; sleeping needs no core, so 4 stages on 2 cores behave as if each had
its own device), on p = 4 stages, m = 1, 2, 4, 8: the idle share of the step measured from
the reference executor's timeline (hooks on each stage, after a warm-up step; the median of
3 runs) next to (p - 1)/(m + p - 1); and the step's length next to the formula's,
(m + p - 1)(t_f + t_b) with the measured t_f and t_b: the difference went to messages (the
formula assumes they are free) and to waiting for a core.
"""

import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "autograder"))

from dpcourse import launch  # noqa: E402
from dpcourse.topics.pipeline.bench import pipeline_step_times, torch_runner  # noqa: E402
from dpcourse.topics.pipeline.runner import PipelineCase, run_pipeline  # noqa: E402
from dpcourse.topics.pipeline.schedules import bubble_fraction  # noqa: E402
from dpcourse.topics.pipeline.stages import layer_stack  # noqa: E402
from dpcourse.topics.pipeline.timeline import measured_bubble, stage_timelines, typical_durations  # noqa: E402
from dpcourse.toys.bench import paired_ratios  # noqa: E402
from dpgrader.pipeline_parallelism.checks import reference_one_f_one_b  # noqa: E402
from dpgrader.pipeline_parallelism.tuned import TunedOneFOneB  # noqa: E402

WIDTH, LINEARS, ROWS, MICRO = 512, 8, 256, 8
STEPS, ROUNDS = 3, 12
TARGET = 1.1


def speed():
    make_model = partial(layer_stack, [WIDTH] * (LINEARS + 1), seed=0, dtype=torch.float32)
    n_layers = 2 * LINEARS - 1
    g = torch.Generator().manual_seed(1)
    X, Y = torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, WIDTH, generator=g)
    variants = {"reference 1F1B": TunedOneFOneB, "torch Schedule1F1B": torch_runner("1F1B"),
                "torch ScheduleGPipe": torch_runner("GPipe")}
    print(f"MLP of {LINEARS} x Linear({WIDTH}, {WIDTH}) float32, {ROWS} rows in m = {MICRO} micro-batches")
    print(f"{'p':>3}  " + "  ".join(f"{name:>26}" for name in variants))
    verdicts = []
    for p in (2, 4):
        per_stage = LINEARS // p
        cuts = [0] + [2 * per_stage * s for s in range(1, p)] + [n_layers]
        times = launch(pipeline_step_times, p, variants, make_model, cuts, X, Y, MICRO, STEPS, ROUNDS,
                       deadline=300)[0]
        ratios = paired_ratios(times, "torch Schedule1F1B", STEPS)
        medians = {name: statistics.median(t) for name, t in times.items()}
        print(f"{p:>3}  " + "  ".join(f"{medians[n] * 1e3:13.1f} ms ({ratios[n]:4.2f}x)" for n in variants))
        verdicts.append((p, ratios["reference 1F1B"]))
    print("(step time / torch Schedule1F1B's step time: median over rounds of per-round ratios, same run)")
    for p, ratio in verdicts:
        print(f"p={p}: reference 1F1B / torch Schedule1F1B = {ratio:.3f}: "
              f"{'within' if ratio <= TARGET else 'ABOVE'} the {TARGET}x target")


def tuned_step(stage, batch, targets, loss_fn, schedule):
    n_micro = sum(1 for kind, _ in schedule if kind == "F")
    return TunedOneFOneB(stage, loss_fn, n_micro)(batch, targets)


def bubble(p=4, forward_ms=10.0, backward_ms=20.0):
    make_model = partial(layer_stack, [16] * (p + 1), seed=0, forward_ms=forward_ms, backward_ms=backward_ms)
    cuts = [0] + [2 * s - 1 for s in range(1, p)] + [2 * p - 1]
    print(f"\nbubble on p = {p} stages of one Linear each, sleeping {forward_ms:g} ms forward and "
          f"{backward_ms:g} ms backward")
    print(f"{'m':>3} {'(p-1)/(m+p-1)':>14} {'measured':>9}   step: measured / with the formula")
    for m in (1, 2, 4, 8):
        g = torch.Generator().manual_seed(m)
        X, Y = torch.randn(2 * m, 16, generator=g, dtype=torch.float64), torch.randn(2 * m, 16, generator=g,
                                                                                  dtype=torch.float64)
        schedules = [reference_one_f_one_b(p, m, s) for s in range(p)]
        case = PipelineCase(make_model, cuts, X, Y, schedule=schedules, warmup=1)
        runs = sorted((stage_timelines(run_pipeline(tuned_step, case, exercise="bench"), case)
                       for _ in range(3)), key=measured_bubble)
        timelines = runs[1]  # the median run
        forward, backward, step = typical_durations(timelines)
        ideal = (m + p - 1) * (forward + backward)
        print(f"{m:>3} {bubble_fraction(p, m):>14.3f} {measured_bubble(timelines):>9.3f}   "
              f"{step * 1e3:.0f} ms / {ideal * 1e3:.0f} ms "
              f"(t_f {forward * 1e3:.1f} ms, t_b {backward * 1e3:.1f} ms)")


def main():
    start = time.perf_counter()
    speed()
    bubble()
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
