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

from dpgrader.judge import sandbox
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

    def judge(self, source, submission, timeout=900, owner=None, budget=None, budget_why=""):
        """`owner`: whose submission this is. Where each rank cannot be isolated from its sandbox's
        warm interpreter (grading without root: ranks run as the same user), a judge serves one
        owner only, so that nothing one learner's ranks did to it can reach another learner.
        `budget`: seconds the submission's launches and calls may take in all (the judge fails the
        cells after it, saying `budget_why`); the judge itself is stopped `timeout` seconds in."""
        if owner != self.owner and self.sandboxed and not can_isolate_ranks():
            self._stop(grace=10.0)
        self.owner = owner
        return self.answer(*self.ask(source, submission, timeout, budget, budget_why))

    def ask(self, source, submission, timeout=900, budget=None, budget_why=""):
        """Hand the judge a submission; `answer` waits for its verdicts. The judge is given copies of
        the two notebooks in its own folder (it sees no other submission, and no solution but this one)."""
        if self.proc is None:
            self._start()
        job_folder = Path(self.folder.name) / "job"
        shutil.rmtree(job_folder, ignore_errors=True)
        job_folder.mkdir()
        source = shutil.copy(source, job_folder / "source.ipynb")
        submission = shutil.copy(submission, job_folder / "submission.ipynb")
        asked = (str(submission), self.log.tell(), time.monotonic() + timeout, timeout)
        job = {"source": str(source), "submission": str(submission), "budget": budget,
               "budget_why": budget_why}
        with contextlib.suppress(OSError):
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
        return asked

    def restart(self):
        """A fresh judge process for the next submission (its sandboxes started again)."""
        self._stop()

    def answer(self, submission, log_start, deadline, timeout):
        """The verdicts on what `ask` handed over, or {"error": why} (the judge is then stopped)."""
        reply, ended = self._reply(max(0.0, deadline - time.monotonic()))
        if reply is not None and reply.get("submission") == submission:
            return reply["verdicts"]
        # The judge ended (its output closed: it is exiting, which may take a while on a loaded
        # machine, so it is waited for until the deadline, not a guessed margin), or it is still
        # at work past the time limit.
        killed = False  # by something outside it: SIGKILL, its own memory limit not reached
        try:
            code = self.proc.wait(max(0.0, deadline - time.monotonic()) if ended else 0.0)
            why = f"exit status {code}"
            if code == -signal.SIGKILL and self.cgroup.memory_failures():
                limit = sandbox.LIMITS["judge_memory_bytes"] >> 20
                why += f": the judge reached its memory limit ({limit} MiB) while judging this notebook"
            else:
                killed = code == -signal.SIGKILL
        except subprocess.TimeoutExpired:
            why = (f"it closed its output but had not exited after {timeout:g} s" if ended
                   else f"stopped after {timeout:g} s")
        self._stop()
        self.log.seek(log_start)
        tail = self.log.read()[-3000:]
        self.log.seek(0, os.SEEK_END)
        return {"error": f"the grader could not judge this notebook ({why}):\n{tail}", "killed": killed}

    def _start(self):
        """Start a judge process: in a memory cgroup of its own (what ranks send it cannot grow it
        past LIMITS["judge_memory_bytes"]), with its scratch folder a tmpfs of a bounded size."""
        command = [sys.executable, "-m", "dpgrader.judge", "--serve"]
        if not self.sandboxed:
            command.append("--no-sandbox")
        os.makedirs(self.scratch, exist_ok=True)
        limit = sandbox.LIMITS["scratch_bytes"]
        self.scratch_mounted = self.sandboxed and sandbox.mount_tmpfs(self.scratch, limit)
        if self.sandboxed and can_isolate_ranks():  # as root: the judge itself sees only what it needs
            command = sandbox.judge_argv(command, self.folder.name, self.scratch)
        self.cgroup = sandbox.Cgroup(memory=sandbox.LIMITS["judge_memory_bytes"],
                                     pids=sandbox.LIMITS["judge_pids"], name="dpcourse-judge")
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, env=_judge_env(self.scratch, self.folder.name),
                                     cwd=self.folder.name, text=True, start_new_session=True)
        self.cgroup.add(self.proc.pid)

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
            self.cgroup.kill_all()
            self.cgroup.remove()
        if getattr(self, "scratch_mounted", False):
            sandbox.unmount(self.scratch)
            self.scratch_mounted = False
        shutil.rmtree(self.scratch, ignore_errors=True)  # what a killed judge left; made again if needed

    def close(self):
        self._stop(grace=10.0)
        self.log.close()
        self.folder.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# What the judge takes from its caller's environment: the grading knobs, nothing else (no gradebook
# URL, no course root, no secret the instructor's shell holds).
JUDGE_SETTINGS = ("DPCOURSE_DEADLINE", "DPCOURSE_GROUP_TIMEOUT", "DPCOURSE_SANDBOX_MEMORY",
                  "DPCOURSE_SANDBOX_PIDS", "DPCOURSE_SANDBOX_SHARED", "DPCOURSE_JUDGE_MEMORY",
                  "DPCOURSE_SANDBOX_SCRATCH", "LANG", "LC_ALL", "TZ")


def _judge_env(scratch, home):
    """The judge's whole environment (an allow-list); `home`: its private working folder."""
    env = {key: os.environ[key] for key in JUDGE_SETTINGS if key in os.environ}
    python_path = [str(AUTOGRADER), str(AUTOGRADER.parent / "course")]
    return dict(env, DPCOURSE_JUDGE_SCRATCH=scratch, PATH=os.defpath, HOME=home,
                PYTHONPATH=os.pathsep.join(python_path), PYTHONDONTWRITEBYTECODE="1")
