"""Notebook 14's job as a torchrun program: a restartable training job, killed where you say.

    torchrun --standalone --nproc-per-node=2 --max-restarts=2 \\
             -m dpcourse.topics.when_ranks_fail.worker my_recovery:train_job \\
             --checkpoint-dir ckpt --interval 2 --steps 8 --kill 1:5:backward --out result.pt

runs `my_recovery.train_job(make_trainer, checkpoint_dir, interval)` (notebook 14's exercise 3) on every
worker, with make_trainer() building the course's Trainer. `--kill RANK:STEP:WHERE[:ATTEMPT]` makes that
rank SIGKILL itself at that step and place of the step (dpcourse.topics.when_ranks_fail.job.PHASES) in
that attempt (default 0). The attempt is torchrun's TORCHELASTIC_RESTART_COUNT: 0 the first time, one
more each time the elastic agent restarts the worker group after a failure (at most --max-restarts
times; LocalElasticAgent._invoke_run in torch/distributed/elastic/agent/server/api.py). Each restart
runs this program again from its first line: whatever train_job resumes, it reads from checkpoint_dir.
Rank 0 of the attempt that finishes saves {"attempt", "report"} to --out.

Used by notebook 14 (the torchrun demo) and tests/library/test_topics_when_ranks_fail.py.
"""

import argparse
import os
from functools import partial

from dpcourse.runtime.cluster import exit_without_teardown, load_target


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m dpcourse.topics.when_ranks_fail.worker")
    parser.add_argument("target", help="MODULE:FUNCTION, e.g. my_recovery:train_job")
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--interval", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--kill", action="append", default=[], help="RANK:STEP:WHERE[:ATTEMPT]")
    parser.add_argument("--out")
    return parser.parse_args(argv)


def kills_for(specs, rank, attempt):
    """The kill faults of `rank` in `attempt`, from RANK:STEP:WHERE[:ATTEMPT] strings."""
    faults = []
    for spec in specs:
        parts = spec.split(":")
        if len(parts) not in (3, 4):
            raise SystemExit(f"--kill takes RANK:STEP:WHERE[:ATTEMPT], got {spec!r}")
        on_rank, step, where = int(parts[0]), int(parts[1]), parts[2]
        on_attempt = int(parts[3]) if len(parts) == 4 else 0
        if on_rank == rank and on_attempt == attempt:
            faults.append({"rank": rank, "step": step, "where": where, "kind": "kill"})
    return faults


def main(argv=None):
    import torch
    import torch.distributed as dist

    from dpcourse.topics.when_ranks_fail.job import Trainer, make_job

    args = parse_args(argv)
    train_job = load_target(args.target)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun
    rank = dist.get_rank()
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    job = make_job(steps=args.steps)
    make_trainer = partial(Trainer, job, faults=kills_for(args.kill, rank, attempt))
    report = train_job(make_trainer, args.checkpoint_dir, args.interval)
    if rank == 0:
        print(f"[attempt {attempt}, {dist.get_world_size()} workers] resumed from step "
              f"{report.get('resumed_from')}, "
              f"final loss {report['losses'][args.steps - 1]!r}", flush=True)
        if args.out:
            torch.save({"attempt": attempt, "report": report}, args.out)
    dist.barrier()  # leave together (see dpcourse.runtime.cluster.main)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
