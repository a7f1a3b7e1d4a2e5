"""nbgrader's autograde pipeline with the judge in it (configured in autograder/nbgrader_config.py).

nbgrader scores a test cell from its outputs (an error output: 0 points). Two steps replace
nbgrader's Execute:
  * `SandboxedExecute` runs the submission's own cells in the sandboxed kernel, for the
    learner's feedback, and leaves every graded test cell alone; a kernel that dies or hangs
    ends this step, not the grading;
  * `JudgeTestCells` runs the judge (dpgrader.judge.cells) in a fresh process, where the
    learner's code never runs, and writes each graded test cell's outputs from its verdict.
So the outputs nbgrader scores were written by the grader after the learner's kernel was gone.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from nbformat.v4 import new_output
from nbgrader.preprocessors import Execute, NbGraderPreprocessor
from traitlets import Bool, Integer, Unicode

from dpgrader.judge.learner import is_graded_test

AUTOGRADER = Path(__file__).resolve().parents[2]


class SandboxedExecute(Execute):
    """nbgrader's Execute without the graded test cells, surviving a kernel that dies or hangs,
    and keeping at most `output_limit` characters of what each cell prints."""

    output_limit = Integer(100_000, help="characters of output kept per cell").tag(config=True)

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

    def preprocess(self, nb, resources=None, km=None):
        try:
            return super().preprocess(nb, resources, km)
        except (CellTimeoutError, DeadKernelError, RuntimeError, TimeoutError) as exc:
            self.log.warning("the submission's kernel stopped (%s): its test cells are judged anyway", exc)
            nb.metadata.setdefault("dpcourse", {})["kernel_stopped"] = f"{type(exc).__name__}: {exc}"
            return nb, resources


class JudgeTestCells(NbGraderPreprocessor):
    """Write every graded test cell's outputs from the judge's verdict (see the module docstring)."""

    source_root = Unicode("", help="the folder of the instructor's notebooks (nbgrader's source)").tag(
        config=True)
    sandbox = Bool(True, help="run the learner's code in sandboxes").tag(config=True)
    timeout = Integer(900, help="seconds the judge may take for one notebook").tag(config=True)

    def preprocess(self, nb, resources):
        names = resources["nbgrader"]
        source = Path(self.source_root) / names["assignment"] / f"{names['notebook']}.ipynb"
        verdicts = run_judge(source, nb, self.sandbox, self.timeout)
        for cell in nb.cells:
            if is_graded_test(cell):
                grade_id = cell.metadata["nbgrader"]["grade_id"]
                cell.outputs = outputs_of(verdicts.get(grade_id))
        return nb, resources


def run_judge(source, nb, sandboxed, timeout):
    """The judge's verdicts for notebook `nb` (a fresh process); raises if the grader itself failed."""
    with tempfile.TemporaryDirectory(prefix="dpcourse-judge-") as folder:
        submission, out = Path(folder) / "submission.ipynb", Path(folder) / "verdicts.json"
        nbformat.write(nb, submission)
        command = [sys.executable, "-m", "dpgrader.judge.cells", str(source), str(submission),
                   "--out", str(out)]
        if not sandboxed:
            command.append("--no-sandbox")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(AUTOGRADER),
                                                                       os.environ.get("PYTHONPATH")])))
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=folder, start_new_session=True)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"the grader could not judge this notebook (exit status {proc.returncode}):\n"
                               + (proc.stderr or proc.stdout)[-3000:])
        return json.loads(out.read_text())


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
