"""nbgrader's autograde pipeline with the judge in it (configured in autograder/nbgrader_config.py).

nbgrader scores a test cell from its outputs (an error output: 0 points). `JudgedExecute`
replaces nbgrader's Execute: it starts the judge (dpgrader.judge.cells) in a fresh process,
where the learner's code never runs; meanwhile it runs the submission's own cells in the
sandboxed kernel, for the learner's feedback, leaving every graded test cell alone (a kernel
that dies or hangs ends this part, not the grading); then it writes each graded test cell's
outputs from the judge's verdict. So the outputs nbgrader scores were written by the grader,
after the learner's kernel was gone.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbformat.v4 import new_output
from nbgrader.preprocessors import Execute
from traitlets import Bool, Integer, Unicode

from dpgrader.judge.cell_kinds import is_graded_test

AUTOGRADER = Path(__file__).resolve().parents[2]


class JudgedExecute(Execute):
    """nbgrader's Execute step, judged: see the module docstring.

    The judge (a separate process) starts first and works while the sandboxed kernel runs the
    submission's own cells; graded test cells are skipped in the kernel and get the judge's
    verdicts as their outputs. A kernel that dies or hangs ends the kernel's part only.
    """

    source_root = Unicode("", help="the folder of the instructor's notebooks (nbgrader's source)").tag(
        config=True)
    sandbox = Bool(True, help="run the learner's code in sandboxes").tag(config=True)
    judge_timeout = Integer(900, help="seconds the judge may take for one notebook").tag(config=True)
    output_limit = Integer(100_000, help="characters of output kept per cell").tag(config=True)
    run_submission = Bool(False, help="also run the submission's own cells in the sandboxed kernel, so that "
                          "the feedback shows their outputs (grades never depend on it)").tag(config=True)

    def preprocess(self, nb, resources=None, km=None):
        names = resources["nbgrader"]
        source = Path(self.source_root) / names["assignment"] / f"{names['notebook']}.ipynb"
        with Judge(source, nb, self.sandbox, self.judge_timeout) as judge:
            try:
                if self.run_submission:
                    nb, resources = super().preprocess(nb, resources, km)
            except Exception as exc:  # noqa: BLE001 - the kernel's part only adds feedback: it never stops grading
                self.log.warning("the submission's kernel stopped (%s): its test cells are judged anyway",
                                 exc)
                nb.metadata.setdefault("dpcourse", {})["kernel_stopped"] = f"{type(exc).__name__}: {exc}"
            verdicts = judge.verdicts()
        for cell in nb.cells:
            if is_graded_test(cell):
                cell.outputs = outputs_of(verdicts.get(cell.metadata["nbgrader"]["grade_id"]))
        return nb, resources

    def preprocess_cell(self, cell, resources, index):
        if is_graded_test(cell):
            return cell, resources
        self._kept = 0
        return super().preprocess_cell(cell, resources, index)

    def output(self, outs, msg, display_id, cell_index):
        size = len(json.dumps(msg.get("content", {})))
        self._kept = getattr(self, "_kept", 0) + size
        if self._kept > self.output_limit:
            if self._kept - size <= self.output_limit:
                note = f"\n... (output cut: more than {self.output_limit} characters)\n"
                outs.append(new_output("stream", name="stdout", text=note))
            return None
        return super().output(outs, msg, display_id, cell_index)


class Judge:
    """The judge of one notebook, running in its own process from `with` until `verdicts()`."""

    def __init__(self, source, nb, sandboxed, timeout):
        self.folder = tempfile.TemporaryDirectory(prefix="dpcourse-judge-")
        folder = Path(self.folder.name)
        submission, self.out = folder / "submission.ipynb", folder / "verdicts.json"
        nbformat.write(nb, submission)
        command = [sys.executable, "-m", "dpgrader.judge.cells", str(source), str(submission),
                   "--out", str(self.out)]
        if not sandboxed:
            command.append("--no-sandbox")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(AUTOGRADER),
                                                                       os.environ.get("PYTHONPATH")])))
        self.log = open(folder / "judge.log", "w+")  # noqa: SIM115 - closed in __exit__
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=folder,
                                     start_new_session=True)
        self.deadline = time.monotonic() + timeout

    def verdicts(self):
        """{grade_id: verdict}; raises if the grader itself failed (no verdict is then given)."""
        try:
            code = self.proc.wait(max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = "timeout"
        if code != 0 or not self.out.exists():
            self.log.seek(0)
            raise RuntimeError(f"the grader could not judge this notebook (exit status {code}):\n"
                               + self.log.read()[-3000:])
        return json.loads(self.out.read_text())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()
        self.folder.cleanup()


def outputs_of(verdict):
    """A cell's outputs for a verdict: what the test printed, then the error if it failed."""
    if verdict is None:
        return [new_output("error", ename="NotGraded", evalue="this test cell was not run by the grader",
                           traceback=["NotGraded: this test cell was not run by the grader"])]
    outputs = []
    if verdict.get("output"):
        outputs.append(new_output("stream", name="stdout", text=verdict["output"]))
    if not verdict["passed"]:
        line = f"{verdict['ename']}: {verdict['evalue']}"
        outputs.append(new_output("error", ename=verdict["ename"], evalue=verdict["evalue"],
                                  traceback=[line]))
    return outputs


class ReplayOutputs(Execute):
    """The record phase of a class run (autograde.py): each cell's outputs as the judged copy of
    the same submission has them (phase 1), so no learner code runs twice."""

    replay_dir = Unicode("", help="where autograde.py's phase 1 left the judged notebooks").tag(config=True)

    def preprocess(self, nb, resources=None, km=None):
        names = resources["nbgrader"]
        path = Path(self.replay_dir) / names["student"] / names["assignment"] / f"{names['notebook']}.ipynb"
        judged = nbformat.read(path, as_version=4)
        by_id = {c.metadata.get("nbgrader", {}).get("grade_id"): c for c in judged.cells}
        same_shape = len(judged.cells) == len(nb.cells)
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
            twin = by_id.get(grade_id) if grade_id else (judged.cells[index] if same_shape else None)
            if twin is not None and twin.cell_type == "code":
                cell.outputs = twin.outputs
            elif is_graded_test(cell):
                cell.outputs = outputs_of(None)
        return nb, resources
