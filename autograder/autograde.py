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

Time: each submission may take BUDGET_FACTOR (3) times the judge time of the instructor's own
solution of its assignment, at least BUDGET_FLOOR (120 s) and at most PER_SUBMISSION_TIMEOUT (900 s):
a notebook that is slow on purpose fails its remaining cells at that point, saying so, and costs the
class no more. The solution's judge time is measured once per change of the course or the grader
(cached under ~/.cache/dpcourse/judge-times/), before the class is judged.

Neighbours: every submission is judged in a pid namespace, cgroup and user ids of its own, so one
student's processes cannot reach another's. Should the grader see, from outside the learner's code,
that the machine ran short while a submission was within its own limits (the kernel refused to fork
one of its ranks, the OOM killer killed one of its processes, its judge was killed from outside), it
is judged again with a fresh judge, the submissions judged alongside it are named, and the run ends
with exit status 1. What a cell's own error says ("can't start new thread") is never such a sign.

The course root and gradebook come from nbgrader_config.py (DPCOURSE_COURSE_ROOT / DPCOURSE_DB_URL
override them). Exit status: 0 when every submission was graded cleanly; 1 when some were not, or
had to be judged again (all listed).
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

PER_SUBMISSION_TIMEOUT = 900  # seconds the judge may spend on one submission, whatever its budget
BUDGET_FACTOR, BUDGET_FLOOR = 3.0, 120.0  # a submission's budget: 3x the solution's judge time, >= 120 s


def course_root():
    return Path(os.environ.get("DPCOURSE_COURSE_ROOT", HERE.parent))


def gradebook_url(root):
    """The gradebook: DPCOURSE_DB_URL, else the course root's (as nbgrader_config.py has it)."""
    return os.environ.get("DPCOURSE_DB_URL") or f"sqlite:///{root / 'autograder' / 'gradebook.db'}"


def take_submissions(root, into, students=None):
    """Copy every submitted/<student>/<assignment>/ folder into `into` (regular files only, opened without
    following links: dpgrader.safe_copy) and return ([(student, assignment, notebook path in `into`)],
    {(student, assignment or None): [lines saying what was refused and why]}).

    Everything after this reads the copy, never submitted/ itself: the judge, and nbgrader (its
    submitted folder is set to the copy, see dpgrader.judge.record). A link there (to solutions/, to a
    classmate's work) is refused and listed, and the student's other real files are kept. Files must
    belong to whoever owns submitted/ (nbgrader's collect writes them as the instructor)."""
    from dpgrader.safe_copy import copy_regular_files, open_folder

    submitted = root / "autograder" / "submitted"
    found, refused = [], {}
    try:
        owner = os.stat(submitted).st_uid
        top = open_folder(submitted)
    except OSError:
        return found, refused
    try:
        with os.scandir(top) as entries:
            students_here = sorted(e.name for e in entries if not e.name.startswith("."))
    finally:
        os.close(top)
    for student in students_here:
        if students and student not in students:
            continue
        try:
            folder = open_folder(submitted, student)
            with os.scandir(folder) as entries:
                assignments = sorted(e.name for e in entries if not e.name.startswith("."))
            os.close(folder)
        except OSError as exc:
            refused[(student, None)] = [f"{student}: refused ({_why_not_a_folder(exc)})"]
            continue
        for assignment in assignments:
            target = into / student / assignment
            try:
                taken = copy_regular_files(submitted, f"{student}/{assignment}", target, owner=owner)
            except OSError as exc:
                why = _why_not_a_folder(exc)
                refused[(student, assignment)] = [f"{student}/{assignment}: refused ({why})"]
                continue
            if taken.refused:
                refused[(student, assignment)] = taken.lines(f"{student}/{assignment}")
            notebooks = sorted(f for f in taken.files if f.endswith(".ipynb") and "/" not in f)
            if not notebooks:
                shutil.rmtree(target, ignore_errors=True)  # nothing nbgrader could grade: not in the copy
            found += [(student, assignment, target / name) for name in notebooks]
    return found, refused


def submitted_assignments(root, students=None):
    """The names of the assignments in submitted/<student>/ (of `students`, else everyone's) that
    solutions/ holds: what a run will time before it grades. Names only, read without following a
    link (a student's link is refused later, by take_submissions)."""
    submitted, names = root / "autograder" / "submitted", set()
    try:
        with os.scandir(submitted) as entries:
            folders = [e for e in entries if e.is_dir(follow_symlinks=False) and not e.name.startswith(".")]
    except OSError:
        return []
    for student in folders:
        if students and student.name not in students:
            continue
        try:
            with os.scandir(student.path) as entries:
                names |= {e.name for e in entries if e.is_dir(follow_symlinks=False)}
        except OSError:
            continue
    return sorted(n for n in names if not n.startswith(".") and (root / "solutions" / n).is_dir())


def _why_not_a_folder(error):
    import errno

    if error.errno == errno.ELOOP:
        return "a symbolic link, not a folder: only regular files and folders are taken"
    return f"not a folder that can be read ({os.strerror(error.errno)})"


def judge_one(worker, student, assignment, notebook, root, verdicts_dir, budget=None):
    """Phase 1 for one submission, by a judge worker: {} or {"error": why}, with "starved": the signs
    that it lacked machine resources, if any; the verdicts are left in verdicts_dir for phase 2."""
    from dpgrader.judge.process import save_verdicts

    try:
        read_notebook(notebook)
    except GradingError as exc:  # named as the instructor knows it: in submitted/, not in this run's copy
        shown = root / "autograder" / "submitted" / student / assignment / notebook.name
        return {"error": str(exc).replace(str(notebook), str(shown))}
    seconds, why = budget or (None, "")
    verdicts = worker.judge(source_notebook(root, assignment), notebook, owner=student, budget=seconds,
                            budget_why=why, timeout=min(PER_SUBMISSION_TIMEOUT, (seconds or 1e9) + 120))
    if "error" in verdicts:  # "killed": the judge's exit status, seen by its worker (not a text)
        return {"error": verdicts["error"], "starved": ["its judge was killed from outside"] * bool(
            verdicts.get("killed"))}
    save_verdicts(verdicts_dir, student, assignment, notebook.stem, verdicts)
    spent = bool(verdicts.get("_budget_spent"))  # set by the judge, not read from a cell's text
    return {"starved": starved(verdicts), "budget_spent": spent}


def starved(verdicts):
    """The signs that the machine, not the submission, ran short while it was judged: only what the
    grader saw outside the learner's code (dpgrader.judge.ranks: a fork of a rank that the kernel refused
    while the submission's cgroup was within its limits, the OOM killer at work while it was within its
    memory limit), never a cell's text (a learner may raise "can't start new thread" themselves)."""
    return [str(sign)[:300] for sign in verdicts.get("_starved", [])][:5]


def budget_for(seconds):
    """(budget in seconds, why) for a submission whose solution the judge judges in `seconds`."""
    if seconds is None:
        return None
    budget = min(PER_SUBMISSION_TIMEOUT, max(BUDGET_FLOOR, BUDGET_FACTOR * seconds))
    return budget, (f": {BUDGET_FACTOR:g}x the {seconds:.0f} s the instructor's solution takes, at least "
                    f"{BUDGET_FLOOR:g} s")


def solution_times(root, assignments, jobs, sandboxed):
    """{assignment: seconds the judge takes on the instructor's solution}, from the cache or measured
    now (`jobs` at a time); an assignment whose solution cannot be judged is left out (no budget)."""
    import concurrent.futures

    from dpgrader.judge.process import JudgeWorker

    times, missing = {}, []
    for assignment in assignments:
        cached = _times_cache(root, assignment)
        try:
            times[assignment] = float(cached.read_text())
        except (OSError, ValueError):
            missing.append(assignment)

    def measure(assignment):
        source = source_notebook(root, assignment)
        with JudgeWorker(sandboxed) as worker:
            worker.judge(source, source, timeout=PER_SUBMISSION_TIMEOUT)  # sandboxes warm, as in the class
            start = time.monotonic()
            verdicts = worker.judge(source, source, timeout=PER_SUBMISSION_TIMEOUT)
            return time.monotonic() - start, verdicts

    if missing:
        print(f"timing the instructor's solution of {len(missing)} assignment(s) (once per change of the "
              f"course or the grader), for the submissions' time budgets")
    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        for assignment, (seconds, verdicts) in zip(missing, pool.map(measure, missing), strict=True):
            cells = [v for k, v in verdicts.items() if not k.startswith("_")]
            if "error" in verdicts or not all(v.get("passed") for v in cells):
                print(f"  {assignment}: the solution does not pass its own tests: no time budget")
                continue
            times[assignment] = seconds
            cached = _times_cache(root, assignment)
            cached.parent.mkdir(parents=True, exist_ok=True)
            cached.write_text(f"{seconds:.3f}")
    return times


def _times_cache(root, assignment):
    """Where the solution's judge time is kept: keyed by the assignment's sources, the grader's code and
    the course library (any change measures again)."""
    import hashlib

    digest = hashlib.sha256()
    files = sorted((root / "solutions" / assignment).rglob("*")) + sorted((HERE / "dpgrader").rglob("*.py"))
    files += sorted((HERE.parent / "course" / "dpcourse").rglob("*.py"))
    for path in files:
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "dpcourse" / "judge-times" / f"{assignment}-{digest.hexdigest()[:16]}"


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

    def __init__(self, subs, root, verdicts_dir, jobs, sandboxed, budgets=None, submitted=None):
        self.subs, self.root, self.verdicts_dir, self.sandboxed = subs, root, verdicts_dir, sandboxed
        self.submitted = submitted  # the copy of submitted/ that nbgrader reads (take_submissions)
        self.budgets = budgets or {}  # assignment -> (seconds, why)
        self.rejudged = {}  # (student, assignment) -> what went wrong first, who was judged alongside
        self.judging = {}  # thread name -> (student, assignment) being judged now
        self.alongside = collections.defaultdict(set)  # (student, assignment) -> submissions judged meanwhile
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
        book = Recorder(self.root, gradebook_url(self.root), self.verdicts_dir, self.sandboxed,
                        submitted=self.submitted)
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
                result = self._judged(worker, student, assignment, notebook)
                if result.get("starved"):  # hurt by something outside it? judged again, by a fresh judge
                    first = result["starved"]
                    worker.restart()
                    result = self._judged(worker, student, assignment, notebook)
                    with self.lock:
                        self.rejudged[(student, assignment)] = {
                            "first": first, "again": result.get("starved") or result.get("error", "")[:200],
                            "alongside": sorted(self.alongside[(student, assignment)])}
                    if result.get("starved"):
                        result = {"error": "could not be judged without running short of machine resources: "
                                           + "; ".join(result["starved"])}
                with self.lock:
                    self.results[(student, assignment)] = result
                    self.left[assignment] -= 1
                    if not self.left[assignment]:
                        self.judged.put(assignment)
                    self._progress(f"{student}/{assignment}")

    def _judged(self, worker, student, assignment, notebook):
        """judge_one, noting which submissions were judged at the same time (for attribution)."""
        me, key = threading.current_thread().name, (student, assignment)
        with self.lock:
            for other in self.judging.values():
                self.alongside[key].add(other)
                self.alongside[other].add(key)
            self.judging[me] = key
        try:
            return judge_one(worker, student, assignment, notebook, self.root, self.verdicts_dir,
                             self.budgets.get(assignment))
        except Exception as exc:  # noqa: BLE001 - a grader bug on one submission: listed, not fatal
            return {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            with self.lock:
                self.judging.pop(me, None)

    def _record(self, book, assignment):
        """Phase 2 for one assignment: into the gradebook, then feedback (failed submissions left out)."""
        from dpgrader.judge.record import StepFailed

        with self.lock:
            excluded = sorted(s for (s, a), r in self.results.items() if a == assignment and r.get("error"))
        # students not asked for (--student) keep what the gradebook has: they are not in the copy
        # nbgrader reads (take_submissions), and are named here as well where it reads submitted/ itself
        judged = {s for s, a, _ in self.subs if a == assignment}
        if self.submitted is None:
            here = self.root / "autograder" / "submitted"
            excluded += sorted({p.parent.name for p in here.glob(f"*/{assignment}")} - judged)
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
    work = root / "autograder" / ".judged"  # this run's: the copy of submitted/, the verdicts
    shutil.rmtree(work, ignore_errors=True)
    subs, refused = take_submissions(root, work / "submitted", args.student)
    if not subs and not refused:
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
    verdicts_dir = work / "verdicts"
    assignments = sorted({a for _, a, _ in subs})
    times = solution_times(root, assignments, args.jobs, not args.no_sandbox)
    budgets = {a: budget_for(times.get(a)) for a in assignments if a in times}
    print(f"grading {len(subs)} submission(s), {args.jobs} at a time; time budget per submission: "
          + ", ".join(f"{a} {b[0]:.0f} s" for a, b in sorted(budgets.items())))
    run = ClassRun(subs, root, verdicts_dir, args.jobs, not args.no_sandbox, budgets,
                   submitted=(work / "submitted").relative_to(root))
    results, problems = run.run() if subs else ({}, [])
    from class_report import record_run  # the verdicts and reasons `make report` reads

    record_run(root, subs, results, verdicts_dir)
    failed = {key: r["error"] for key, r in results.items() if r.get("error")}
    graded = {(s, a) for s, a, _ in subs}
    refusals = []  # files left out of submissions that were graded all the same
    for (student, assignment), lines in sorted(refused.items(), key=str):
        if (student, assignment) in graded:
            refusals += lines
        else:  # no notebook left to grade: not graded
            failed[(student, assignment or "*")] = "nothing left to grade: " + "; ".join(lines)
    print(f"grades: {root / 'autograder' / 'grades.csv'}; feedback: {root / 'autograder' / 'feedback'}")
    for assignment in unknown:
        print(f"skipped {assignment}: no such assignment in solutions/")
    spent = sorted(f"{s}/{a}" for (s, a), r in results.items() if r.get("budget_spent"))
    if spent:
        print(f"stopped at their time budget (the cells after it scored 0, saying so): {', '.join(spent)}")
    for (student, assignment), why in sorted(run.rejudged.items()):
        print(f"\njudged again: {student}/{assignment}: its first judging failed for want of machine "
              f"resources ({'; '.join(why['first'])[:300]}), while "
              + (", ".join(f"{s}/{a}" for s, a in why["alongside"]) or "nothing else")
              + " was judged alongside; "
              + (f"judged again: {why['again']}" if why["again"] else "judged again cleanly (that grade is "
                 "recorded)"))
    if failed or problems or run.rejudged or refusals:
        total = len(graded | set(failed))
        print(f"\nnot graded ({len(failed)} of {total}):" if failed or problems or refusals else "")
        for (student, assignment), reason in sorted(failed.items()):
            first, *detail = reason.strip().splitlines() or ["(no reason given)"]
            print(f"  {student}/{assignment}: {first[:300]}")
            for line in detail[-6:]:  # the end of the grader's log says what went wrong
                print(f"      {line[:300]}")
        for line in refusals:  # files left out of a submission (the rest of it was graded)
            print(f"  {line[:300]}")
        for problem in problems:
            print(f"  {problem}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
