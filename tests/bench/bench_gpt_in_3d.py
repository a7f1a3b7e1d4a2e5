"""Notebook 13's layouts on 8 ranks: each one's step time against pure data parallelism, and against the
planner's prediction, as ratios in one run.

The notebook's GPT with sequences of 64 (4 blocks, d_model 128, 4 heads; float32), a global batch of 16, two
micro-batches where there is a pipeline, trained with the notebook's own solutions (autograder/dpgrader/
gpt_in_3d/tuned.py) in (8, 1, 1), (2, 2, 2), (1, 2, 4), (2, 1, 4) and (4, 2, 1). Every layout is built in one
launch and its steps are timed round by round in a rotating order (runtime.timing.interleaved_step_times: a
barrier before each step, the first round a warm-up; a step's time is the slowest rank's). Table 1: median
step time and the median of the per-round ratios to (8, 1, 1). Table 2: the planner (topics.gpt_in_3d.costs,
calibrated on the same 8 ranks just before) against the measured medians, and its ranking of the layouts
against the measured one. No target: the numbers say how far an alpha-beta model is from 8 ranks sharing 2
cores (the written answer of the notebook asks why).
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "autograder"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dpcourse import launch  # noqa: E402
from dpcourse.reference.lm import Recipe, batches_of  # noqa: E402
from dpcourse.runtime.timing import interleaved_step_times  # noqa: E402
from dpcourse.topics.gpt_in_3d.costs import calibrate, predict  # noqa: E402
from dpcourse.topics.gpt_in_3d.runs import build_3d, stage_inputs  # noqa: E402
from dpcourse.topics.tensor.realapi import quiet_dtensor  # noqa: E402
from dpcourse.toys.gpt import GPTConfig  # noqa: E402
from dpcourse.toys.text import samples  # noqa: E402
from dpgrader.gpt_in_3d.tuned import PIECES  # noqa: E402

LAYOUTS = [(8, 1, 1), (2, 2, 2), (1, 2, 4), (2, 1, 4), (4, 2, 1)]
CONFIG = GPTConfig(seq=64)
BATCH, N_MICRO, ROUNDS, REPEATS = 16, 2, 5, 2


def n_micro(layout):
    return N_MICRO if layout[1] > 1 else 1


def time_layouts(rows):
    """Inside a rank: {layout: [seconds per step]}, every layout built here and stepped in turn."""
    torch.set_num_threads(1)
    recipe = Recipe(batch=BATCH, total=1000)
    with quiet_dtensor():
        runs = {layout: build_3d(PIECES, CONFIG, layout, 0, recipe, n_micro(layout), torch.float32)
                for layout in LAYOUTS}
        batches = {layout: stage_inputs(rows, layout, dist.get_rank()) for layout in LAYOUTS}
        steps = {str(layout): (lambda layout=layout: PIECES["train_step"](runs[layout], *batches[layout]))
                 for layout in LAYOUTS}
        return interleaved_step_times(steps, rounds=ROUNDS, repeats=REPEATS)


def main():
    start = time.perf_counter()
    rows = batches_of(samples(64, CONFIG.seq, seed=0), Recipe(batch=BATCH), 1)[0]
    per_rank = launch(time_layouts, 8, rows, deadline=900, group_timeout=120)
    times = {name: [max(r[name][i] for r in per_rank) for i in range(len(per_rank[0][name]))]
             for name in per_rank[0]}  # a step's time: the slowest rank's
    machine = calibrate(8)
    base = str(LAYOUTS[0])
    print(f"{CONFIG.n_layers} blocks, d_model {CONFIG.d_model}, seq {CONFIG.seq}, batch {BATCH}, float32, 8 "
          f"ranks; "
          f"{ROUNDS - 1} timed rounds of {REPEATS} steps")
    print(f"{'layout':>10} {'median':>9} {'vs (8,1,1)':>11} {'predicted':>10} {'measured/predicted':>19}")
    measured, predicted = {}, {}
    for layout in LAYOUTS:
        name = str(layout)
        measured[name] = statistics.median(times[name])
        guess = predict(CONFIG, layout, batch=BATCH, n_micro=n_micro(layout), machine=machine)
        predicted[name] = guess["time"]
        ratio = statistics.median(a / b for a, b in zip(times[name], times[base], strict=True))
        print(f"{name:>10} {measured[name] * 1e3:7.0f}ms {ratio:10.2f}x {predicted[name] * 1e3:8.0f}ms "
              f"{measured[name] / predicted[name]:18.2f}x")
    order = lambda table: [n for n, _ in sorted(table.items(), key=lambda kv: kv[1])]  # noqa: E731
    print(f"fastest to slowest, measured:  {', '.join(order(measured))}")
    print(f"fastest to slowest, predicted: {', '.join(order(predicted))}")
    print(f"this machine as 8 ranks: {machine['flops'] / 1e9:.2f} GFLOP/s per rank, alpha "
          f"{machine['alpha'] * 1e6:.0f} us, beta {machine['beta_intra'] / 1e9:.2f} GB/s "
          f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
