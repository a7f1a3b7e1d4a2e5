"""Grade the whole class: every submission in the submitted folder, into the gradebook.

    python autograder/autograde.py                # what `make autograde` runs (JOBS=2 by default)
    python autograder/autograde.py --jobs 4 --no-sandbox

Two phases, so that one bad submission never stops the others and the class grades in parallel:
  1. judge: the submissions (submitted/<student>/<assignment>/<notebook>.ipynb) are judged in
     batches of one assignment, JOBS batches at a time, each batch by one judge process
     (dpgrader.judge: learner code only in sandboxed ranks). A submission that cannot be read,
     breaks the judge or runs past its time limit is judged again alone and, if it fails again,
     listed with the reason; the others go on.
  2. record: nbgrader, in this process, for each assignment: generate_assignment into the class
     gradebook, autograde (each test cell's output is its verdict from phase 1: no learner code
     runs again), feedback (hidden tests cleared); then grades.csv. Submissions that failed
     phase 1 are left out and listed.

The course root and gradebook come from nbgrader_config.py (DPCOURSE_COURSE_ROOT / DPCOURSE_DB_URL
override them). Exit status: 0 when every submission was graded, 1 when some were not (listed).
"""

import argparse
import concurrent.futures
import json
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # dpgrader, and grade.py's notebook check

from grade import GradingError, read_notebook  # noqa: E402

PER_SUBMISSION_TIMEOUT = 900  # seconds the judge may spend on one submission
BATCH = 8  # submissions of one assignment judged by one judge process (its sandboxes start once)


def course_root():
    return Path(os.environ.get("DPCOURSE_COURSE_ROOT", HERE.parent))


def submissions(root):
    """[(student, assignment, notebook path)] for every notebook in submitted/<student>/<assignment>/."""
    found = []
    for folder in sorted((root / "autograder" / "submitted").glob("*/*")):
        if folder.is_dir():
            for notebook in sorted(folder.glob("*.ipynb")):
                found.append((folder.parent.name, folder.name, notebook))
    return found


def judge_batch(batch, assignment, root, verdicts_dir, sandboxed):
    """Phase 1 for several submissions of one assignment, in one judge process (its sandboxes
    started once): {student: {} or {"error": why}}; the verdicts are left in verdicts_dir."""
    from dpgrader.judge.process import judge_notebooks, verdicts_path

    out, readable = {}, []
    for student, notebook in batch:
        try:
            read_notebook(notebook)
            readable.append((student, notebook))
        except GradingError as exc:
            out[student] = {"error": str(exc)}
    source = source_notebook(root, assignment)
    judged = judge_notebooks(source, [nb for _, nb in readable], sandboxed, timeout=PER_SUBMISSION_TIMEOUT)
    for student, notebook in readable:
        verdicts = judged[str(notebook)]
        if "error" in verdicts:
            out[student] = {"error": verdicts["error"]}
            continue
        target = verdicts_path(verdicts_dir, student, assignment, notebook.stem)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(verdicts))
        out[student] = {}
    return out


def source_notebook(root, assignment):
    """The instructor's notebook of an assignment (solutions/<assignment>/, one notebook each)."""
    return next((root / "solutions" / assignment).glob("*.ipynb"))


def batches(subs, jobs, size=BATCH):
    """[(assignment, [(student, notebook), ...])]: each assignment's submissions cut into batches of at
    most `size`, and into at least `jobs` batches where there are enough, so the workers share them."""
    by_assignment = {}
    for student, assignment, notebook in subs:
        by_assignment.setdefault(assignment, []).append((student, notebook))
    out = []
    for assignment, items in by_assignment.items():
        count = max(1, min(len(items), max(jobs, -(-len(items) // size))))
        for k in range(count):
            chunk = items[k::count]
            if chunk:
                out.append((assignment, chunk))
    return out


def progress(done, total, current, start):
    width = 30
    filled = int(width * done / max(total, 1))
    line = (
        f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total}  {time.monotonic() - start:6.0f} s  "
        f"{current:<40.40}"
    )
    print(line, end="", flush=True)


def judge_class(subs, root, verdicts_dir, jobs, sandboxed):
    """Phase 1 for every submission, `jobs` batches at a time; returns {(student, assignment): result}."""
    results, start = {}, time.monotonic()
    progress(0, len(subs), "", start)
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {
            pool.submit(judge_batch, batch, assignment, root, verdicts_dir, sandboxed): (assignment, batch)
            for assignment, batch in batches(subs, jobs)
        }
        for future in concurrent.futures.as_completed(futures):
            assignment, batch = futures[future]
            try:
                done = future.result()
            except Exception as exc:  # noqa: BLE001 - a grader bug on one batch: listed, not fatal
                done = {student: {"error": f"{type(exc).__name__}: {exc}"} for student, _ in batch}
            for student, result in done.items():
                results[(student, assignment)] = result
            progress(len(results), len(subs), f"{batch[-1][0]}/{assignment}", start)
    print()
    return results


def record_class(root, assignments, failed, verdicts_dir, sandboxed):
    """Phase 2: the class gradebook, feedback and grades.csv, from phase 1's verdicts (one process)."""
    from dpgrader.judge.record import Recorder, StepFailed

    book = Recorder(root, os.environ.get("DPCOURSE_DB_URL"), verdicts_dir, sandboxed)
    problems, start = [], time.monotonic()
    for done, assignment in enumerate(assignments):
        progress(done, len(assignments), f"recording {assignment}", start)
        excluded = sorted(s for s, a in failed if a == assignment)
        for step in (book.generate, book.autograde, book.feedback):
            try:
                step(assignment) if step == book.generate else step(assignment, exclude=excluded)
            except StepFailed as exc:
                problems.append(str(exc))
    book.export(root / "autograder" / "grades.csv")
    progress(len(assignments), len(assignments), "recorded", start)
    print()
    return problems


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--jobs",
        type=int,
        default=int(os.environ.get("JOBS", 2)),
        help="submissions graded at once (default: $JOBS or 2)",
    )
    parser.add_argument(
        "--no-sandbox", action="store_true", help="grade without the sandbox (not for a class)"
    )
    args = parser.parse_args(argv)
    root = course_root()
    subs = submissions(root)
    if not subs:
        print(
            f"no submissions in {root / 'autograder' / 'submitted'} "
            "(expected submitted/<student>/<assignment>/<notebook>.ipynb)"
        )
        return 0
    unknown = sorted({a for _, a, _ in subs if not (root / "solutions" / a).is_dir()})
    subs = [s for s in subs if s[1] not in unknown]
    if not args.no_sandbox:
        from dpgrader.judge.sandbox import SandboxUnavailable, require

        try:
            require()
        except SandboxUnavailable as exc:
            print(f"grading refused: {exc}", file=sys.stderr)
            return 2
    verdicts_dir = root / "autograder" / ".judged"
    shutil.rmtree(verdicts_dir, ignore_errors=True)
    print(f"grading {len(subs)} submission(s), {args.jobs} at a time")
    results = judge_class(subs, root, verdicts_dir, args.jobs, not args.no_sandbox)
    failed = {key: r["error"] for key, r in results.items() if r.get("error")}
    problems = record_class(root, sorted({a for _, a, _ in subs}), failed, verdicts_dir, not args.no_sandbox)
    print(f"grades: {root / 'autograder' / 'grades.csv'}; feedback: {root / 'autograder' / 'feedback'}")
    for assignment in unknown:
        print(f"skipped {assignment}: no such assignment in solutions/")
    if failed or problems:
        print(f"\nnot graded ({len(failed)} of {len(subs)}):")
        for (student, assignment), reason in sorted(failed.items()):
            first, *detail = reason.strip().splitlines() or ["(no reason given)"]
            print(f"  {student}/{assignment}: {first[:300]}")
            for line in detail[-6:]:  # the end of the grader's log says what went wrong
                print(f"      {line[:300]}")
        for problem in problems:
            print(f"  {problem}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
