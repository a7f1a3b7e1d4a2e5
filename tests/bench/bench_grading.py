"""Grading speed: one notebook, one learner's whole course, and a class, as `make autograde` runs them.

    .venv/bin/python tests/bench/bench_grading.py [--learners 30] [--jobs 2] [--skip-class]

Figures printed (wall clock on this machine, with what else was running noted by the load):
  * per notebook: `grade.py` on each solution notebook (the judge, then nbgrader recording its
    verdicts in a scratch gradebook: what `make grade` costs), and the judge alone on the same
    notebook (what a grade costs without nbgrader's own work);
  * per learner: `autograde.py` on one learner who submitted every notebook (JOBS=2);
  * per class: `autograde.py` on `--learners` copies of that learner (JOBS=2).
The targets (the grader-trust issue): <= 10 s median per notebook, <= 90 s per learner. Each is
reported as a ratio to its target and to BEFORE, the same figures measured on this kind of machine (2
cores) before the grader's third trust round and the one case runner (main at 448640b): those changes
were to keep grading within 1.1x of them. Nothing is asserted (speed is measured here, never in tests);
the load printed says how comparable a run is.
grade.py records in a gradebook that generate_assignment makes once per change of solutions/
(cached): the bench grades each released notebook first, so the figures are those of a warm cache.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
AUTOGRADER = REPO / "autograder"
PER_NOTEBOOK_TARGET, PER_LEARNER_TARGET = 10.0, 90.0
BEFORE = {"per notebook": 8.0, "judge alone": 6.8, "per learner": 62.0}  # seconds, at 448640b
BEFORE_COUNT = 13  # ... over notebooks 00-12: the ratios to BEFORE are of those notebooks only


def comparable(names):
    """The assignments BEFORE was measured on (00-12): 13 and 14 came later."""
    return [a for a in names if int(a[:2]) < BEFORE_COUNT]


def assignments():
    sys.path.insert(0, str(AUTOGRADER))
    from dpgrader.chapters import assignments as every

    return every(REPO)


def notebook_of(assignment):
    return next((REPO / "solutions" / assignment).glob("*.ipynb"))


def timed(command, env=None, cwd=None):
    start = time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=7200)
    return time.monotonic() - start, proc


def per_notebook():
    released = [REPO / "course" / a / notebook_of(a).name for a in assignments()]
    timed([sys.executable, str(AUTOGRADER / "grade.py"), *map(str, released), "--json"])  # warm the cache
    rows = []
    for assignment in assignments():
        nb = notebook_of(assignment)
        graded, proc = timed([sys.executable, str(AUTOGRADER / "grade.py"), str(nb), "--json"])
        ok = proc.returncode == 0
        judged, _ = timed(
            [sys.executable, "-m", "dpgrader.judge", str(nb), str(nb), "--out", os.devnull],
            env=dict(os.environ, PYTHONPATH=str(AUTOGRADER)),
            cwd=AUTOGRADER,
        )
        rows.append((assignment, graded, judged, ok))
        print(
            f"  {assignment:<28} grade.py {graded:6.1f} s   judge alone {judged:6.1f} s"
            + ("" if ok else "   (grade.py failed)"),
            flush=True,
        )
    median = statistics.median(r[1] for r in rows)
    judge = statistics.median(r[2] for r in rows)
    old = [r for r in rows if r[0] in comparable([r[0] for r in rows])]
    then, then_judge = statistics.median(r[1] for r in old), statistics.median(r[2] for r in old)
    print(f"  median per notebook: {median:.1f} s = {median / PER_NOTEBOOK_TARGET:.2f}x the 10 s target "
          f"(the judge alone: {judge:.1f} s)")
    print(f"  over 00-12: median {then:.1f} s = {then / BEFORE['per notebook']:.2f}x before's "
          f"{BEFORE['per notebook']} s; the judge alone {then_judge:.1f} s = "
          f"{then_judge / BEFORE['judge alone']:.2f}x before's {BEFORE['judge alone']} s")
    return rows


def autograde_class(learners, jobs, submitted=None):
    """Seconds `autograde.py --jobs` takes on `learners` learners who each submitted every notebook (or
    the assignments `submitted`)."""
    with tempfile.TemporaryDirectory(prefix="dpcourse-bench-") as folder:
        root = Path(folder)
        shutil.copytree(REPO / "solutions", root / "solutions")
        shutil.copytree(REPO / "course", root / "course", ignore=shutil.ignore_patterns("dpcourse"))
        for learner in range(learners):
            for assignment in submitted or assignments():
                target = root / "autograder" / "submitted" / f"learner{learner:02d}" / assignment
                target.mkdir(parents=True)
                shutil.copy(notebook_of(assignment), target)
        env = dict(
            os.environ, DPCOURSE_COURSE_ROOT=str(root), DPCOURSE_DB_URL=f"sqlite:///{root / 'gradebook.db'}"
        )
        seconds, proc = timed(
            [sys.executable, str(AUTOGRADER / "autograde.py"), "--jobs", str(jobs)], env=env
        )
        if proc.returncode != 0:
            print(proc.stdout[-2000:], proc.stderr[-2000:])
        return seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--learners", type=int, default=30)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--skip-class", action="store_true")
    args = parser.parse_args(argv)
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print("per notebook (solutions):")
    per_notebook()
    # autograde.py times each solution once per change of the course or grader (the submissions' time
    # budgets); done here, untimed, so that the figures below are those of a class run with a warm cache
    warm = (f"import sys; sys.path.insert(0, {str(AUTOGRADER)!r}); from pathlib import Path; "
            f"import autograde; autograde.solution_times(Path({str(REPO)!r}), {assignments()!r}, "
            f"{args.jobs}, True)")
    timed([sys.executable, "-c", warm])
    one = autograde_class(1, args.jobs)
    print(f"per learner (every notebook, JOBS={args.jobs}): {one:.0f} s = {one / PER_LEARNER_TARGET:.2f}x "
          f"the 90 s target")
    then = autograde_class(1, args.jobs, comparable(assignments()))
    print(f"per learner of 00-12: {then:.0f} s = {then / BEFORE['per learner']:.2f}x before's "
          f"{BEFORE['per learner']:.0f} s")
    if not args.skip_class:
        many = autograde_class(args.learners, args.jobs)
        total = args.learners * len(assignments())
        print(
            f"class of {args.learners} learners x {len(assignments())} notebooks (JOBS={args.jobs}): "
            f"{many / 60:.1f} min, {many / total:.1f} s per submission"
        )
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
