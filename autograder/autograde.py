"""Grade the whole class: every submission in the submitted folder, into the gradebook.

    python autograder/autograde.py                # what `make autograde` runs (JOBS=2 by default)
    python autograder/autograde.py --jobs 4 --no-sandbox

Two phases, so that one bad submission never stops the others and the class grades in parallel:
  1. judge: the submissions (submitted/<student>/<assignment>/<notebook>.ipynb) are graded in
     batches of one assignment, JOBS batches at a time, each in a scratch course with its own
     gradebook (grade.py): a sandboxed kernel for each notebook's cells, the judge for its test
     cells. A submission that cannot be read, crashes the grader or runs past its time limit is
     listed with the reason; the others go on.
  2. record: for each assignment, one `nbgrader autograde` over the class gradebook replays the
     outputs phase 1 computed (no learner code runs again), then feedback (hidden tests cleared)
     and grades.csv. Submissions that failed phase 1 are left out and listed.

The course root and gradebook come from nbgrader_config.py (DPCOURSE_COURSE_ROOT / DPCOURSE_DB_URL
override them). Exit status: 0 when every submission was graded, 1 when some were not (listed).
"""

import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PER_SUBMISSION_TIMEOUT = 1800  # seconds phase 1 may spend on one submission
BATCH = 8  # submissions of one assignment graded by one grade.py run (nbgrader starts once per batch)


def course_root():
    return Path(os.environ.get("DPCOURSE_COURSE_ROOT", HERE.parent))


def nbgrader(*args, env=None, check=True):
    env = dict(env or os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "nbgrader", *args],
        cwd=HERE,
        env=env,
        capture_output=True,
        text=True,
        timeout=6 * 3600,
    )
    if check and proc.returncode != 0:
        raise RuntimeError(f"nbgrader {' '.join(args)} failed:\n{(proc.stderr or proc.stdout)[-3000:]}")
    return proc


def submissions(root):
    """[(student, assignment, notebook path)] for every notebook in submitted/<student>/<assignment>/."""
    found = []
    for folder in sorted((root / "autograder" / "submitted").glob("*/*")):
        if folder.is_dir():
            for notebook in sorted(folder.glob("*.ipynb")):
                found.append((folder.parent.name, folder.name, notebook))
    return found


def judge_batch(batch, assignment, replay_dir, sandboxed):
    """Phase 1 for several submissions of one assignment, in one grade.py run (one nbgrader start for
    all of them): {student: result}, and each graded copy saved for phase 2."""
    scratch = replay_dir / "scratch" / f"{assignment}-{batch[0][0]}"
    shutil.rmtree(scratch, ignore_errors=True)
    command = [
        sys.executable,
        str(HERE / "grade.py"),
        *(str(nb) for _, nb in batch),
        "--assignment",
        assignment,
        "--json",
        "--keep",
        str(scratch),
    ]
    if not sandboxed:
        command.append("--no-sandbox")
    try:
        proc = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=PER_SUBMISSION_TIMEOUT * len(batch),
            start_new_session=True,
        )
    except subprocess.TimeoutExpired:
        return {
            student: {
                "error": f"grading took longer than {PER_SUBMISSION_TIMEOUT} s a notebook and was stopped"
            }
            for student, _ in batch
        }
    try:
        results = json.loads(proc.stdout)
    except ValueError:
        reason = "the grader failed: " + (proc.stderr or proc.stdout).strip()[-1500:]
        return {student: {"error": reason} for student, _ in batch}
    results = results if isinstance(results, list) else [results]
    out = {}
    for index, ((student, notebook), result) in enumerate(zip(batch, results, strict=True)):
        graded = scratch / "autograder" / "autograded" / f"learner{index}" / assignment / notebook.name
        if result.get("error") or not graded.exists():
            out[student] = {"error": result.get("error") or "nbgrader wrote no graded notebook"}
            continue
        target = replay_dir / student / assignment / notebook.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(graded, target)
        out[student] = result
    shutil.rmtree(scratch, ignore_errors=True)
    return out


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


def judge_class(subs, replay_dir, jobs, sandboxed):
    """Phase 1 for every submission, `jobs` batches at a time; returns {(student, assignment): result}."""
    results, start = {}, time.monotonic()
    progress(0, len(subs), "", start)
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {
            pool.submit(judge_batch, batch, assignment, replay_dir, sandboxed): (assignment, batch)
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


def record_class(root, assignments, failed, replay_dir):
    """Phase 2: the class gradebook, feedback and grades.csv, from phase 1's outputs."""
    env = dict(os.environ, DPCOURSE_REPLAY_DIR=str(replay_dir))
    problems = []
    for assignment in assignments:
        excluded = ",".join(sorted(s for s, a in failed if a == assignment))
        extra = [f"--CourseDirectory.student_id_exclude={excluded}"] if excluded else []
        for step in ("generate_assignment", "autograde", "generate_feedback"):
            args = [step, assignment, "--force", *(extra if step != "generate_assignment" else [])]
            proc = nbgrader(*args, env=env, check=False)
            if proc.returncode != 0:
                problems.append(
                    f"{assignment}: nbgrader {step} reported errors:\n" + _errors(proc.stderr or proc.stdout)
                )
    nbgrader("export", "--to", str(root / "autograder" / "grades.csv"), env=env)
    return problems


def _errors(log):
    lines = [line for line in log.splitlines() if "ERROR" in line or "Error" in line]
    return "\n".join((lines or log.splitlines())[-15:])


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
        sys.path.insert(0, str(HERE))
        from dpgrader.judge.sandbox import SandboxUnavailable, require

        try:
            require()
        except SandboxUnavailable as exc:
            print(f"grading refused: {exc}", file=sys.stderr)
            return 2
    replay_dir = root / "autograder" / ".judged"
    shutil.rmtree(replay_dir, ignore_errors=True)
    print(f"grading {len(subs)} submission(s), {args.jobs} at a time")
    results = judge_class(subs, replay_dir, args.jobs, not args.no_sandbox)
    failed = {key: r["error"] for key, r in results.items() if r.get("error")}
    problems = record_class(root, sorted({a for _, a, _ in subs}), failed, replay_dir)
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
