"""When ranks fail: what a checkpoint and a restart cost, as ratios to one training step of the same job.

Notebook 14's job (dpcourse.topics.when_ranks_fail.job.Trainer) made big enough for its checkpoint to be
measured: 64 features, 2,048 hidden units (137,218 float64 parameters, 1.1 MB; on disk, with AdamW's two
moments sharded over the ranks and the random states, 3.4 MB), on N = 2 and 4 ranks (gloo, the CPU). The
checkpoint is the notebook's own save_checkpoint / load_checkpoint (its solution cells,
dpgrader.solutions): torch.distributed.checkpoint, every rank writing its own file into one folder.

Per launch, every rank times (medians over rounds, steps interleaved with saves and loads so that a busy
machine slows all of them alike):
  * one training step (the unit);
  * one save_checkpoint, and one load_checkpoint into a fresh trainer: as ratios to the step, and per MB
    of checkpoint on disk (the folder's bytes);
  * restart to first step: from the moment the caller starts a new launch (fork, process group, a fresh
    trainer, load_checkpoint) to the end of the first step after the load, measured against the caller's
    clock (time.monotonic is one clock for every process of the machine). This is the course's launcher;
    under torchrun every worker of a restart is a fresh interpreter that imports torch (seconds more:
    notebook 14 shows it).
"""

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "autograder"))

import torch.distributed as dist  # noqa: E402

from dpcourse import launch  # noqa: E402
from dpcourse.topics.when_ranks_fail.job import Trainer, make_job  # noqa: E402
from dpgrader.solutions import solution_functions  # noqa: E402

JOB = make_job(features=64, hidden=2048, samples=96, global_batch=24, steps=1000)
ROUNDS = 5


def folder_megabytes(folder):
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)) / 1e6


def step_save_load(save, load, folder):
    trainer = Trainer(JOB)
    trainer.train_step()  # warm-up
    steps, saves, loads = [], [], []
    for round_ in range(ROUNDS):
        started = time.perf_counter()
        trainer.train_step()
        steps.append(time.perf_counter() - started)
        path = os.path.join(folder, f"round{round_}")
        started = time.perf_counter()
        save(path, trainer)
        saves.append(time.perf_counter() - started)
        fresh = Trainer(JOB)
        started = time.perf_counter()
        load(path, fresh)
        loads.append(time.perf_counter() - started)
    dist.barrier()
    megabytes = folder_megabytes(os.path.join(folder, "round0")) if dist.get_rank() == 0 else None
    return statistics.median(steps), statistics.median(saves), statistics.median(loads), megabytes


def restart(load, folder):
    trainer = Trainer(JOB)
    load(os.path.join(folder, "round0"), trainer)
    trainer.train_step()
    return time.monotonic()


def main():
    started = time.perf_counter()
    namespace = solution_functions("14_when_ranks_fail", "exact_checkpoint")[0].__globals__
    save, load = namespace["save_checkpoint"], namespace["load_checkpoint"]
    params = sum(p.numel() for p in Trainer.__init__.__globals__["build_model"](JOB).parameters())
    print(f"notebook 14's job, {params:,} float64 parameters; checkpoints by the notebook's save_checkpoint")
    print(f"{'N':>3} {'step':>9} {'save/step':>10} {'load/step':>10} {'MB':>6} {'save/MB/step':>13} "
          f"{'load/MB/step':>13} {'restart/step':>13}")
    for world in (2, 4):
        with tempfile.TemporaryDirectory() as folder:
            results = launch(step_save_load, world, save, load, folder, deadline=300)
            step = statistics.median(r[0] for r in results)
            saving = max(r[1] for r in results)  # a save ends when its slowest rank's write does
            loading = max(r[2] for r in results)
            megabytes = results[0][3]
            restarts = []
            for _ in range(3):
                began = time.monotonic()
                restarts.append(max(launch(restart, world, load, folder, deadline=120)) - began)
        restart_time = statistics.median(restarts)
        print(f"{world:>3} {step * 1e3:>7.1f}ms {saving / step:>10.1f} {loading / step:>10.1f} "
              f"{megabytes:>6.2f} {saving / megabytes / step:>13.1f} {loading / megabytes / step:>13.1f} "
              f"{restart_time / step:>13.1f}")
    print(f"(load average {os.getloadavg()[0]:.1f}; {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
