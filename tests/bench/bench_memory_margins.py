"""Memory measured from outside the ranks: how far honest solutions stay below their bounds, and how far
hidden copies go above them (notebook 10's ZeRO-1/2/3 memory cells, 07's 1F1B memory cell).

    .venv/bin/python tests/bench/bench_memory_margins.py [--repeats 3] [--busy 4] [--attacks]

Each measured launch of a hidden check (dpcourse.topics.zero.measured, dpcourse.topics.pipeline.measured)
runs `--repeats` times in the grader's sandboxed ranks (dpgrader.judge.ranks.RankPool, as the judge runs
them), on the instructor's solution and, with --attacks, on the hidden copies of the fault catalogue
(tests/grader/test_hostile_submissions.py). For every rank: the most it held beyond its bound's
starting point, the bound, and their ratio (held / allowed: < 1 passes). `--busy N` runs N busy loops
beside it (a loaded machine). How memory was measured ("cgroup" as root, "rss+tmpfs" without) is
printed. Nothing is asserted: the tests assert pass or fail; this prints the margins.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "autograder"), str(REPO / "tests"), str(REPO / "tests" / "grader")]
MB = 1 << 20


def zero_margins(memory):
    """What one rank of a zero run held after its worst step beyond "before", and at "before" beyond its
    start (as the checks compute them; start_anon: the measurement before the grader-trust issue's third
    round, kept so that the same script measures a baseline checkout)."""
    from dpcourse.topics.zero import measured

    marks = {label: held for label, held, *_ in memory["marks"]}
    steps = [marks[f"after step {s}"] - marks["before"] for s in range(measured.STEPS)]
    return max(steps), marks["before"] - memory.get("start_held", memory.get("start_anon"))


def run_zero(stage, learner, repeats):
    import math

    from dpcourse.comm.calls import launch_run
    from dpcourse.runtime.launcher import launch_options, observed_memory
    from dpcourse.topics.zero import measured

    run = {"zero1": measured.zero1_memory_run, "zero2": measured.zero2_memory_run,
           "zero3": measured.zero3_memory_run}[stage]
    rows = []
    for _ in range(repeats):
        with launch_options(measure_memory=True):
            results = launch_run(run, measured.WORLD, learner)
        numel = results[0]["numel"]
        shard = math.ceil(numel / measured.WORLD) * 8
        count, _ = measured.NEEDS[stage]
        allowed = count * shard + measured.SLACK
        models, _ = measured.BEFORE[stage]
        allowed_before = models * numel * 8 + measured.PROGRAM_SLACK
        for memory in observed_memory():
            held, before = zero_margins(memory)
            rows.append((held, allowed, before, allowed_before, memory.get("how", "RssAnon")))
    return rows


def run_pipeline(learner, repeats):
    from dpcourse.comm.calls import launch_run
    from dpcourse.runtime.launcher import launch_options, observed_memory
    from dpcourse.topics.pipeline import measured
    from dpgrader.pipeline_parallelism.checks import reference_one_f_one_b

    schedules = [reference_one_f_one_b(measured.STAGES, measured.MICRO, s) for s in range(measured.STAGES)]
    rows = []
    for _ in range(repeats):
        with launch_options(measure_memory=True, exercise="run_schedule"):
            launch_run(measured.schedule_memory_run, measured.STAGES, learner, schedules)
        for rank, memory in enumerate(observed_memory()):
            marks = {label: held for label, held, *_ in memory["marks"]}
            held = max(v - marks["before"] for k, v in marks.items() if k.startswith("after forward "))
            in_flight = min(measured.STAGES - rank, measured.MICRO)
            allowed = in_flight * measured.KEPT[rank] * measured.ACTIVATION + measured.SLACK
            rows.append((held, allowed, None, None, memory.get("how", "RssAnon")))
    return rows


def variants(with_attacks):
    """(name, assignment, extra cells inserted after a solution cell): the solution, then the attacks."""
    found = [("solution", "10_zero_and_fsdp", None, []), ("solution", "07_pipeline_parallelism", None, [])]
    if with_attacks:
        import test_hostile_submissions as catalogue

        for name, (assignment, after, cells, *_) in catalogue.MEMORY_ATTACKS.items():
            found.append((name, assignment, after, cells))
    return found


def program_of(assignment, after, cells):
    """The learner program of the solution of `assignment`, with `cells` after the cell `after` (the
    catalogue's attack notebook, written to a folder removed at once)."""
    from dpgrader.judge.learner import program_cells, read_notebook

    path = next((REPO / "solutions" / assignment).glob("*.ipynb"))
    if after is None:
        return program_cells(read_notebook(path))
    import test_hostile_submissions as catalogue

    folder = Path(tempfile.mkdtemp(prefix="margins-", dir="/var/tmp"))
    try:
        return program_cells(read_notebook(catalogue._attack_notebook(folder, "attack", assignment, after,
                                                                      cells)))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--busy", type=int, default=0, help="busy loops beside the measurement")
    parser.add_argument("--attacks", action="store_true",
                        help="also the hidden copies of the fault catalogue")
    args = parser.parse_args()
    import cloudpickle

    import dpgrader
    from dpgrader.judge.learner import LearnerProxy
    from dpgrader.judge.ranks import RankPool
    from dpgrader.judge.zygotes import shared_scratch

    cloudpickle.register_pickle_by_value(dpgrader)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    pool = RankPool(sandboxed=True, prestart=2, scratch=shared_scratch())
    print(f"load {os.getloadavg()[0]:.1f}, {args.busy} busy loop(s); held / allowed per rank (MiB), "
          f"{args.repeats} repeats")
    try:
        with pool.installed():
            for name, assignment, after, cells in variants(args.attacks):
                pool.set_program(program_of(assignment, after, cells))
                zero = ((1, "ShardedOptimizer"), (2, "reduce_scatter_gradients"), (3, "MiniFSDP"))
                checks = ([(f"zero{n}", cls) for n, cls in zero] if assignment.startswith("10")
                          else [("1f1b", "run_schedule")])
                for check, learner in checks:
                    try:
                        rows = (run_zero(check, LearnerProxy(learner), args.repeats) if check != "1f1b"
                                else run_pipeline(LearnerProxy(learner), args.repeats))
                    except Exception as exc:  # noqa: BLE001 - an attack may break the run: say so
                        print(f"  {name:<34} {check:<6} failed: {str(exc).splitlines()[0][:120]}")
                        continue
                    ratios = [held / allowed for held, allowed, *_ in rows]
                    worst = max(rows, key=lambda r: r[0] / r[1])
                    line = (f"  {name:<34} {check:<6} [{worst[4]}] held {worst[0] / MB:6.2f} of "
                            f"{worst[1] / MB:6.2f}"
                            f"  ratio max {max(ratios):.2f} median {statistics.median(ratios):.2f}"
                            f"  margin {(worst[1] - worst[0]) / MB:+.2f}")
                    if worst[2] is not None:
                        before = max(r[2] / r[3] for r in rows)
                        line += f"  | before: ratio max {before:.2f}"
                    print(line, flush=True)
            pool.end_submission()
    finally:
        pool.close()
        shutil.rmtree(pool.scratch, ignore_errors=True)
        for proc in busy:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
