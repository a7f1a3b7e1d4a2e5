"""The instructor's side of the class's grading service (hub/grading_service.py): `make autograde` and the
formgrader's Autograde button on the hub judge through it, and record as the instructor.

    python hub/grading_client.py --jobs 3 [--student ada]  # `make autograde` on the hub (the Makefile runs
                                                            # it where DPCOURSE_GRADING_SOCKET is set)
    grading_client.install()                                # hub/config/instructor/nbgrader_config.py

`RemoteJudgeWorker` has dpgrader's JudgeWorker's interface (judge, ask/answer, restart, close), and
`install()` puts it in JudgeWorker's place in dpgrader.judge.process, so that autograde.py (its workers
and its timing of the solutions) and JudgedExecute (the Autograde button, through process.Judge) judge
in the service without a change of their own. Each worker is one connection to the service, which
keeps one root judge per connection; the notebook goes over the socket as text, the verdicts come
back. The service judges against the repository's solutions/, chosen by assignment name.

The first `make autograde` of a class times the instructor's solution of each assignment first (for the
submissions' time budgets; autograde.py caches the times): here it says so, one line per assignment as
each is timed, instead of minutes with nothing on screen.
"""

import argparse
import json
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

HUB = Path(__file__).resolve().parent
AUTOGRADER = HUB.parent / "autograder"
SOCKET = "DPCOURSE_GRADING_SOCKET"
MARGIN = 120  # seconds past the judge's own limit before the client gives up on an answer


class RemoteJudgeWorker:
    """dpgrader.judge.process.JudgeWorker, the judge in the class's grading service (module docstring)."""

    def __init__(self, sandboxed=True):
        self.sandboxed = sandboxed  # always sandboxed there: the service judges as `make autograde` as root
        # process.Judge (the Autograde button's path) writes the notebook it is given here
        self.folder = tempfile.TemporaryDirectory(prefix="dpcourse-judge-client-")
        self.connection = self.stream = None

    def _connect(self):
        path = os.environ[SOCKET]
        self.connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.connection.connect(path)
        except OSError as exc:
            self.connection.close()
            self.connection = None
            raise RuntimeError(f"the class's grading service does not answer at {path} ({exc.strerror}): is "
                               f"the hub running? (make hub starts it)") from None
        self.stream = self.connection.makefile("rwb")

    def judge(self, source, submission, timeout=900, owner=None, budget=None, budget_why=""):
        return self.answer(*self.ask(source, submission, timeout, budget, budget_why, owner=owner))

    def ask(self, source, submission, timeout=900, budget=None, budget_why="", owner=None):
        """Hand the service a submission (its text: the service opens nothing the instructor names)."""
        if self.connection is None:
            self._connect()
        fd = os.open(submission, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            text = f.read().decode("utf-8", errors="replace")
        request = {"assignment": Path(source).parent.name, "student": owner, "notebook": text,
                   "timeout": timeout, "budget": budget, "budget_why": budget_why}
        self._send(request)
        return (timeout + MARGIN,)

    def answer(self, wait):
        reply = self._receive(wait)
        if "verdicts" in reply:
            return reply["verdicts"]
        return {"error": f"the grader could not judge this notebook ({reply.get('error', 'no answer')})"}

    def restart(self):
        """A fresh judge for the next submission (the service restarts the one of this connection)."""
        if self.connection is not None:
            self._send({"restart": True})
            self._receive(MARGIN)

    def _send(self, message):
        try:
            self.stream.write(json.dumps(message).encode() + b"\n")
            self.stream.flush()
        except OSError:
            self._drop()

    def _receive(self, wait):
        if self.connection is None:
            return {"error": "the grading service closed the connection"}
        self.connection.settimeout(wait)
        try:
            line = self.stream.readline()
        except (OSError, TimeoutError):
            self._drop()
            return {"error": f"no answer from the grading service within {wait:.0f} s"}
        if not line:
            self._drop()
            return {"error": "the grading service closed the connection"}
        return json.loads(line)

    def _drop(self):
        """Forget the connection (the next submission opens a new one: a fresh judge in the service)."""
        for closable in (self.stream, self.connection):
            try:
                closable and closable.close()
            except OSError:
                pass
        self.connection = self.stream = None

    def close(self):
        self._drop()
        self.folder.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def install():
    """Judge through the service from now on, in this process (autograde.py, nbgrader's Autograde)."""
    sys.path.insert(0, str(AUTOGRADER))
    from dpgrader.judge import process

    process.JudgeWorker = RemoteJudgeWorker


def time_solutions_saying_so(autograde, root, assignments, jobs):
    """Time the instructor's solution of each assignment not timed yet (autograde.solution_times, one
    assignment per call, `jobs` at a time), printing a line as each is done; autograde.main then finds
    them all in its cache."""
    import concurrent.futures

    missing = [a for a in assignments if not autograde._times_cache(root, a).exists()]
    if not missing:
        return
    print(f"timing the instructor's solution of {len(missing)} assignment(s) first, for the submissions' "
          f"time budgets (once per change of the course or the grader; about twice the judge time of each)",
          flush=True)
    started, done, lock = time.monotonic(), [0], threading.Lock()

    def one(assignment):
        times = autograde.solution_times(root, [assignment], 1, True)
        with lock:
            done[0] += 1
            took = f"{times[assignment]:.0f} s to judge" if assignment in times else "no time budget"
            so_far = time.monotonic() - started
            print(f"  [{done[0]}/{len(missing)}] {assignment}: {took} ({so_far:.0f} s so far)", flush=True)

    def quiet(*args, **kwargs):  # autograde's own line, once per call here, said once above
        if not str(args[0] if args else "").startswith("timing the instructor's solution"):
            print(*args, **kwargs)

    autograde.print = quiet  # shadows the builtin in that module only, while timing
    try:
        with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
            list(pool.map(one, missing))
    finally:
        del autograde.print


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not os.environ.get(SOCKET):
        print(f"hub/grading_client.py judges through a class's grading service: {SOCKET} is not set (run "
              f"`make autograde` in the instructor's JupyterLab on the hub)", file=sys.stderr)
        return 2
    install()
    import autograde

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("JOBS", 2)))
    parser.add_argument("--student", action="append")
    known, _ = parser.parse_known_args(argv)
    root = autograde.course_root()
    try:
        assignments = autograde.submitted_assignments(root, known.student)
        time_solutions_saying_so(autograde, root, assignments, known.jobs)
    except AttributeError as exc:  # autograde.py changed its helpers: it then times them itself, silently
        print(f"(not timing the solutions beforehand: {exc})", flush=True)
    return autograde.main(argv)


if __name__ == "__main__":
    sys.exit(main())
