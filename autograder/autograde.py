"""Grade the whole class: every submission in the submitted folder, into the gradebook.

    python autograder/autograde.py                # what `make autograde` runs (JOBS=2 by default)
    python autograder/autograde.py --jobs 4 --no-sandbox
    python autograder/autograde.py --student ada      # one student again (a late submission)

Two phases, so that one bad submission never stops the others and the class grades in parallel
(they overlap: an assignment is recorded as soon as its last submission is judged):
  1. judge: the submissions (submitted/<student>/<assignment>/<notebook>.ipynb) are judged by
     JOBS judge workers (dpgrader.judge: learner code only in sandboxed ranks), each taking the
     next submission as it finishes one. A submission that cannot be read, breaks its judge or
     runs past its time limit is listed with the reason; its worker starts a fresh judge and the
     others go on.
  2. record: nbgrader, in this process, for each assignment: generate_assignment into the class
     gradebook, autograde (each test cell's output is its verdict from phase 1: no learner code
     runs again), feedback (hidden tests cleared); then grades.csv. Submissions that failed
     phase 1 are left out and listed.

The course root and gradebook come from nbgrader_config.py (DPCOURSE_COURSE_ROOT / DPCOURSE_DB_URL
override them). Exit status: 0 when every submission was graded, 1 when some were not (listed).
"""

import argparse
import collections
import os
import queue
import shutil
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # dpgrader, and grade.py's notebook check

from grade import GradingError, read_notebook  # noqa: E402

PER_SUBMISSION_TIMEOUT = 900  # seconds the judge may spend on one submission


def course_root():
    return Path(os.environ.get("DPCOURSE_COURSE_ROOT", HERE.parent))


def gradebook_url(root):
    """The gradebook: DPCOURSE_DB_URL, else the course root's (as nbgrader_config.py has it)."""
    return os.environ.get("DPCOURSE_DB_URL") or f"sqlite:///{root / 'autograder' / 'gradebook.db'}"


def submissions(root):
    """[(student, assignment, notebook path)] for every notebook in submitted/<student>/<assignment>/."""
    found = []
    for folder in sorted((root / "autograder" / "submitted").glob("*/*")):
        if folder.is_dir():
            for notebook in sorted(folder.glob("*.ipynb")):
                found.append((folder.parent.name, folder.name, notebook))
    return found


def judge_one(worker, student, assignment, notebook, root, verdicts_dir):
    """Phase 1 for one submission, by a judge worker: {} or {"error": why}; the verdicts are left
    in verdicts_dir for phase 2."""
    from dpgrader.judge.process import save_verdicts

    try:
        read_notebook(notebook)
    except GradingError as exc:
        return {"error": str(exc)}
    verdicts = worker.judge(source_notebook(root, assignment), notebook, timeout=PER_SUBMISSION_TIMEOUT,
                            owner=student)
    if "error" in verdicts:
        return {"error": verdicts["error"]}
    save_verdicts(verdicts_dir, student, assignment, notebook.stem, verdicts)
    return {}


def source_notebook(root, assignment):
    """The instructor's notebook of an assignment (solutions/<assignment>/, one notebook each)."""
    return next((root / "solutions" / assignment).glob("*.ipynb"))


def progress(judged, recorded, subs, assignments, current, start):
    width = 30
    filled = int(width * judged / max(subs, 1))
    line = (
        f"\r[{'#' * filled}{'.' * (width - filled)}] judged {judged}/{subs}, recorded {recorded}/"
        f"{assignments} assignments  {time.monotonic() - start:6.0f} s  {current:<36.36}"
    )
    print(line, end="", flush=True)


class ClassRun:
    """Both phases at once: `jobs` judge workers take submissions from one queue, in assignment
    order, each starting the next as it finishes one (its sandboxes start once); the calling thread
    records each assignment in the gradebook as soon as its last submission is judged."""

    def __init__(self, subs, root, verdicts_dir, jobs, sandboxed):
        self.subs, self.root, self.verdicts_dir, self.sandboxed = subs, root, verdicts_dir, sandboxed
        self.waiting = sorted(subs, key=lambda s: (s[1], s[0]), reverse=True)  # pop() takes the first
        self.left = collections.Counter(assignment for _, assignment, _ in subs)
        self.results, self.problems, self.recorded = {}, [], 0
        self.lock, self.judged = threading.Lock(), queue.Queue()  # assignments whose judging is over
        self.start = time.monotonic()
        self.threads = [threading.Thread(target=self._work, daemon=True) for _ in range(max(1, jobs))]

    def run(self):
        """{(student, assignment): {} or {"error": why}} and the recording problems."""
        from dpgrader.judge.record import Recorder

        self._progress("")
        for thread in self.threads:
            thread.start()
        book = Recorder(self.root, gradebook_url(self.root), self.verdicts_dir, self.sandboxed)
        for _ in range(len(self.left)):
            assignment = self._next_judged()
            if assignment is None:
                break
            self._record(book, assignment)
        for thread in self.threads:
            thread.join()
        book.export(self.root / "autograder" / "grades.csv")
        self._progress("done")
        print()
        return self.results, self.problems

    def _next_judged(self):
        """The next assignment whose submissions are all judged; None if every worker stopped first
        (a grader bug: what was not judged is listed as such)."""
        while True:
            try:
                return self.judged.get(timeout=1.0)
            except queue.Empty:
                if not any(thread.is_alive() for thread in self.threads) and self.judged.empty():
                    with self.lock:
                        for student, assignment, _ in self.subs:
                            self.results.setdefault((student, assignment),
                                                    {"error": "not judged: the grader's workers stopped"})
                    return None

    def _work(self):
        from dpgrader.judge.process import JudgeWorker

        with JudgeWorker(self.sandboxed) as worker:
            while True:
                with self.lock:
                    if not self.waiting:
                        return
                    student, assignment, notebook = self.waiting.pop()
                try:
                    result = judge_one(worker, student, assignment, notebook, self.root, self.verdicts_dir)
                except Exception as exc:  # noqa: BLE001 - a grader bug on one submission: listed, not fatal
                    result = {"error": f"{type(exc).__name__}: {exc}"}
                with self.lock:
                    self.results[(student, assignment)] = result
                    self.left[assignment] -= 1
                    if not self.left[assignment]:
                        self.judged.put(assignment)
                    self._progress(f"{student}/{assignment}")

    def _record(self, book, assignment):
        """Phase 2 for one assignment: into the gradebook, then feedback (failed submissions left out)."""
        from dpgrader.judge.record import StepFailed

        with self.lock:
            excluded = sorted(s for (s, a), r in self.results.items() if a == assignment and r.get("error"))
        # students not asked for (--student) keep what the gradebook has
        judged = {s for s, a, _ in self.subs if a == assignment}
        excluded += sorted({s for s, a, _ in submissions(self.root) if a == assignment} - judged)
        for step in (book.generate, book.autograde, book.feedback):
            try:
                step(assignment) if step == book.generate else step(assignment, exclude=excluded)
            except StepFailed as exc:
                self.problems.append(str(exc))
        with self.lock:
            self.recorded += 1
            self._progress(f"recorded {assignment}")

    def _progress(self, current):
        progress(len(self.results), self.recorded, len(self.subs), len(self.left), current, self.start)


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
    parser.add_argument(
        "--student", action="append", help="grade only this student's submissions (again: a late one); "
        "the others keep their grades. Repeat for several"
    )
    args = parser.parse_args(argv)
    root = course_root()
    subs = [s for s in submissions(root) if not args.student or s[0] in args.student]
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
    results, problems = ClassRun(subs, root, verdicts_dir, args.jobs, not args.no_sandbox).run()
    failed = {key: r["error"] for key, r in results.items() if r.get("error")}
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
