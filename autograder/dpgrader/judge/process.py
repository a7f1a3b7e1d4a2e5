"""The judge in a process of its own: started, waited for with a deadline, its verdicts read back.

    with JudgeWorker(sandboxed=True) as worker:                      # one submission at a time
        worker.judge(source, path)                                   # {grade_id: verdict}
    with Judge(source, nb, sandboxed=True, timeout=900) as judge:   # one notebook, in the background
        judge.verdicts()

No nbgrader here (it takes seconds to import): grade.py starts the judge first and imports
nbgrader while the judge works.
"""

import contextlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dpgrader.judge.sandbox import can_isolate_ranks
from dpgrader.judge.zygotes import new_scratch_folder

AUTOGRADER = Path(__file__).resolve().parents[2]


def verdicts_path(folder, student, assignment, notebook):
    """Where a judging done beforehand leaves one submission's verdicts."""
    return Path(folder) / student / assignment / f"{notebook}.json"


def save_verdicts(folder, student, assignment, notebook, verdicts):
    """Leave one submission's verdicts where JudgedExecute (through Verdicts) reads them back."""
    target = verdicts_path(folder, student, assignment, notebook)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(verdicts))


class Verdicts:
    """Verdicts judged beforehand (JudgeWorker), read back for nbgrader to record."""

    def __init__(self, path):
        self.path = path

    def verdicts(self):
        if not self.path.exists():
            raise RuntimeError(f"no verdicts were given for this notebook ({self.path} is missing)")
        return json.loads(self.path.read_text())


class Judge:
    """One notebook (nbformat) judged in the background, from `with` until `verdicts()`: what
    JudgedExecute does when nbgrader's autograde is run by hand (the kernel runs meanwhile)."""

    def __init__(self, source, nb, sandboxed, timeout):
        import nbformat

        self.worker = JudgeWorker(sandboxed)
        submission = Path(self.worker.folder.name) / "submission.ipynb"
        nbformat.write(nb, submission)
        self.asked = self.worker.ask(source, submission, timeout)

    def verdicts(self):
        """{grade_id: verdict}; raises if the grader itself failed (no verdict is then given)."""
        verdicts = self.worker.answer(*self.asked)
        if "error" in verdicts:
            raise RuntimeError(verdicts["error"])
        return verdicts

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.worker.close()


class JudgeWorker:
    """A judge process that judges submissions one at a time, as they are handed to it.

    Its sandboxes start once (seconds) and serve every submission after, whatever the assignment;
    each submission has its own time limit. A judge that fails or runs past the limit is killed,
    the submission it was judging gets the error (with the end of the judge's log), and the next
    submission starts a fresh judge: one submission that breaks or stalls the grader costs only
    its own grade. autograde.py runs JOBS of these; grade.py one.

        with JudgeWorker(sandboxed=True) as worker:
            worker.judge(source, path, timeout=900)   # {grade_id: verdict} or {"error": why}
    """

    def __init__(self, sandboxed=True):
        self.sandboxed, self.proc, self.owner = sandboxed, None, None
        self.folder = tempfile.TemporaryDirectory(prefix="dpcourse-judge-")
        self.scratch = new_scratch_folder()
        self.log = open(Path(self.folder.name) / "judge.log", "w+")  # noqa: SIM115 - closed in close()

    def judge(self, source, submission, timeout=900, owner=None):
        """`owner`: whose submission this is. Where each rank cannot be isolated from its sandbox's
        warm interpreter (grading without root: ranks run as the same user), a judge serves one
        owner only, so that nothing one learner's ranks did to it can reach another learner."""
        if owner != self.owner and self.sandboxed and not can_isolate_ranks():
            self._stop(grace=10.0)
        self.owner = owner
        return self.answer(*self.ask(source, submission, timeout))

    def ask(self, source, submission, timeout=900):
        """Hand the judge a submission; `answer` waits for its verdicts."""
        if self.proc is None:
            self._start()
        asked = (str(submission), self.log.tell(), time.monotonic() + timeout, timeout)
        with contextlib.suppress(OSError):
            self.proc.stdin.write(json.dumps({"source": str(source), "submission": str(submission)}) + "\n")
            self.proc.stdin.flush()
        return asked

    def answer(self, submission, log_start, deadline, timeout):
        """The verdicts on what `ask` handed over, or {"error": why} (the judge is then stopped)."""
        reply, ended = self._reply(max(0.0, deadline - time.monotonic()))
        if reply is not None and reply.get("submission") == submission:
            return reply["verdicts"]
        # The judge ended (its output closed: it is exiting, which may take a while on a loaded
        # machine, so it is waited for until the deadline, not a guessed margin), or it is still
        # at work past the time limit.
        try:
            code = self.proc.wait(max(0.0, deadline - time.monotonic()) if ended else 0.0)
            why = f"exit status {code}"
        except subprocess.TimeoutExpired:
            why = (f"it closed its output but had not exited after {timeout:g} s" if ended
                   else f"stopped after {timeout:g} s")
        self._stop()
        self.log.seek(log_start)
        tail = self.log.read()[-3000:]
        self.log.seek(0, os.SEEK_END)
        return {"error": f"the grader could not judge this notebook ({why}):\n{tail}"}

    def _start(self):
        command = [sys.executable, "-m", "dpgrader.judge", "--serve"]
        if not self.sandboxed:
            command.append("--no-sandbox")
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, env=_judge_env(self.scratch), cwd=self.folder.name,
                                     text=True, start_new_session=True)

    def _reply(self, timeout):
        """(the judge's next line as JSON or None, whether its output ended): None, False when
        `timeout` seconds pass first."""
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            if not selector.select(timeout):
                return None, False
        line = self.proc.stdout.readline()
        if not line:
            return None, True
        try:
            return json.loads(line), False
        except ValueError:
            return None, False

    def _stop(self, grace=0.0):
        """End the judge: killed at once (it failed or stalled), or given `grace` seconds to finish
        on its own once told there is no more work (it then removes what it made)."""
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            with contextlib.suppress(OSError):
                self.proc.stdout.close()
            self.proc = None
        shutil.rmtree(self.scratch, ignore_errors=True)  # what a killed judge left; made again if needed

    def close(self):
        self._stop(grace=10.0)
        self.log.close()
        self.folder.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _judge_env(scratch):
    return dict(os.environ, DPCOURSE_JUDGE_SCRATCH=scratch,
                PYTHONPATH=os.pathsep.join(filter(None, [str(AUTOGRADER), os.environ.get("PYTHONPATH")])))
