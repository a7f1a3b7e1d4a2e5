"""nbgrader's autograde pipeline with the judge in it (configured in autograder/nbgrader_config.py).

nbgrader scores a test cell from its outputs (an error output: 0 points). `JudgedExecute`
replaces nbgrader's Execute: it starts the judge (dpgrader.judge.cells) in a fresh process,
where the learner's code never runs; meanwhile it runs the submission's own cells in the
sandboxed kernel, for the learner's feedback, leaving every graded test cell alone (a kernel
that dies or hangs ends this part, not the grading); then it writes each graded test cell's
outputs from the judge's verdict. So the outputs nbgrader scores were written by the grader,
after the learner's kernel was gone.
"""

import contextlib
import json
from pathlib import Path

from nbformat.v4 import new_output
from nbgrader.preprocessors import Execute
from traitlets import Bool, Integer, Unicode

from dpgrader.judge.cell_kinds import is_graded_test
from dpgrader.judge.process import Judge, Verdicts, verdicts_path


class JudgedExecute(Execute):
    """nbgrader's Execute step, judged: see the module docstring.

    The judge (a separate process) starts first and works while the sandboxed kernel runs the
    submission's own cells; graded test cells are skipped in the kernel and get the judge's
    verdicts as their outputs. A kernel that dies or hangs ends the kernel's part only.
    With `verdicts_dir` (grade.py and autograde.py judge first, then record with nbgrader), the
    verdicts are read from there instead: <verdicts_dir>/<student>/<assignment>/<notebook>.json.
    """

    source_root = Unicode("", help="the folder of the instructor's notebooks (nbgrader's source)").tag(
        config=True)
    sandbox = Bool(True, help="run the learner's code in sandboxes").tag(config=True)
    judge_timeout = Integer(900, help="seconds the judge may take for one notebook").tag(config=True)
    output_limit = Integer(100_000, help="characters of output kept per cell").tag(config=True)
    run_submission = Bool(False, help="also run the submission's own cells in the sandboxed kernel, so that "
                          "the feedback shows their outputs (grades never depend on it)").tag(config=True)
    verdicts_dir = Unicode("", help="where the verdicts of a judging done beforehand are (empty: judge "
                           "each notebook here)").tag(config=True)

    def preprocess(self, nb, resources=None, km=None):
        names = resources["nbgrader"]
        source = Path(self.source_root) / names["assignment"] / f"{names['notebook']}.ipynb"
        given = verdicts_path(self.verdicts_dir, names["student"], names["assignment"], names["notebook"])
        folder = resources.get("metadata", {}).get("path")
        if not self.verdicts_dir and folder:  # nbgrader read submitted/ itself (the formgrader's button)
            _refuse_links(Path(folder) / f"{names['notebook']}.ipynb")
        with (contextlib.nullcontext(Verdicts(given)) if self.verdicts_dir
              else Judge(source, nb, self.sandbox, self.judge_timeout)) as judge:
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


def _refuse_links(path):
    """Refuse a submitted notebook that is a link (to solutions/, to a classmate's): autograde.py takes
    submissions through dpgrader.safe_copy, but nbgrader run by hand reads submitted/ as it is."""
    import os
    import stat

    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        raise RuntimeError(f"{path} is not a regular file of its own (a symbolic or hard link): refused, "
                           f"only regular files are graded")


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
