"""The judge in a process of its own: started, waited for with a deadline, its verdicts read back.

    with Judge(source, [path, ...], sandboxed=True, timeout=900) as judge:
        judge.verdicts()                    # {path: {grade_id: verdict}}
    judge_notebooks(source, paths)          # the same, a submission that breaks the judge isolated

No nbgrader here (it takes seconds to import): grade.py starts the judge first and imports
nbgrader while the judge works.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

AUTOGRADER = Path(__file__).resolve().parents[2]


def verdicts_path(folder, student, assignment, notebook):
    """Where a judging done beforehand leaves one submission's verdicts."""
    return Path(folder) / student / assignment / f"{notebook}.json"


class Verdicts:
    """Verdicts judged beforehand (judge_notebooks), read back for nbgrader to record."""

    def __init__(self, path):
        self.path = path

    def verdicts(self):
        if not self.path.exists():
            raise RuntimeError(f"no verdicts were given for this notebook ({self.path} is missing)")
        return json.loads(self.path.read_text())


class Judge:
    """The judge of one or more notebooks, running in its own process from `with` until `verdicts()`.

    `nb` is a notebook (nbformat) or a list of submission paths; for a list, `verdicts()` returns
    {path: verdicts}, the judge reusing its sandboxes from one submission to the next.
    """

    def __init__(self, source, nb, sandboxed, timeout):
        self.folder = tempfile.TemporaryDirectory(prefix="dpcourse-judge-")
        folder = Path(self.folder.name)
        self.out = folder / "verdicts.json"
        if isinstance(nb, list):
            submissions = [str(path) for path in nb]
            spec = folder / "submissions.json"
            spec.write_text(json.dumps([{"submission": path, "only": None} for path in submissions]))
            what = ["--spec", str(spec)]
        else:
            import nbformat

            submission = folder / "submission.ipynb"
            nbformat.write(nb, submission)
            what = [str(submission)]
        command = [sys.executable, "-m", "dpgrader.judge.cells", str(source), *what, "--out", str(self.out)]
        if not sandboxed:
            command.append("--no-sandbox")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(AUTOGRADER),
                                                                       os.environ.get("PYTHONPATH")])))
        self.log = open(folder / "judge.log", "w+")  # noqa: SIM115 - closed in __exit__
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=folder,
                                     start_new_session=True)
        self.timeout, self.deadline = timeout, time.monotonic() + timeout

    def verdicts(self):
        """{grade_id: verdict}; raises if the grader itself failed (no verdict is then given)."""
        try:
            code = self.proc.wait(max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = f"none: stopped after {self.timeout:g} s"
        if code != 0 or not self.out.exists():
            self.log.seek(0)
            raise RuntimeError(f"the grader could not judge this notebook (exit status {code}):\n"
                               + self.log.read()[-3000:])
        return json.loads(self.out.read_text())

    def finished(self):
        """What a judge of several notebooks wrote before it stopped: {path: verdicts}."""
        try:
            return json.loads(self.out.read_text())
        except (OSError, ValueError):
            return {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()
        self.folder.cleanup()


def judge_notebooks(source, submissions, sandboxed=True, timeout=900):
    """{path: verdicts, or {"error": why}} for submissions of one assignment, judged together.

    One judge process for all of them (its sandboxes started once). If it fails or runs past
    `timeout` seconds a notebook, what it finished is kept, the submission it was judging is
    judged again alone and the rest together: a submission that breaks or stalls the grader
    costs only its own grade.
    """
    paths = [str(path) for path in submissions]
    if not paths:
        return {}
    with Judge(source, paths, sandboxed, timeout * len(paths)) as judge:
        try:
            return judge.verdicts()
        except RuntimeError as exc:
            done, failure = judge.finished(), str(exc)
    if len(paths) == 1:
        return {paths[0]: {"error": failure}}
    rest = [path for path in paths if path not in done]
    culprit = judge_notebooks(source, rest[:1], sandboxed, timeout)
    return {**done, **culprit, **judge_notebooks(source, rest[1:], sandboxed, timeout)}
