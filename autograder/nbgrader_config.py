"""nbgrader configuration of the course.

The course root is the repository: solutions/ is nbgrader's source directory,
course/ its release directory, and the instructor's working folders (submitted,
autograded, feedback, gradebook) live under autograder/ and are git-ignored.
nbgrader reads this file from its working directory, so the Makefile runs
nbgrader from autograder/ (grade.py writes its own copy for a scratch course).
"""

import os
import pathlib
import runpy

from nbconvert.preprocessors import ClearMetadataPreprocessor
from nbgrader.preprocessors import (
    AssignLatePenalties,
    CheckCellMetadata,
    IgnorePattern,
    LimitOutput,
    SaveAutoGrades,
)

from dpgrader.judge.kernel import KERNEL_NAME, kernelspec
from dpgrader.judge.steps import JudgedExecute

here = os.path.dirname(os.path.abspath(__file__))
# the course's one table of timeouts, read without importing dpcourse (whose package imports torch:
# nbgrader's own processes need none of it)
TIMEOUTS = runpy.run_path(os.path.join(here, "..", "course", "dpcourse", "runtime",
                                       "timeouts.py"))["TIMEOUTS"]
c = get_config()  # provided by traitlets when it loads this file

c.CourseDirectory.root = os.environ.get("DPCOURSE_COURSE_ROOT", os.path.dirname(here))
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "course"
c.CourseDirectory.submitted_directory = "autograder/submitted"
c.CourseDirectory.autograded_directory = "autograder/autograded"
c.CourseDirectory.feedback_directory = "autograder/feedback"
# what nbgrader writes stays in the course root (the repository, or a class's on the hub: hub/)
work = os.path.join(c.CourseDirectory.root, "autograder")
c.CourseDirectory.db_url = os.environ.get(
    "DPCOURSE_DB_URL", "sqlite:///" + os.path.join(work, "gradebook.db"))
# A class on JupyterHub (`make hub`) names its course and nbgrader's exchange; alone, neither is used.
c.CourseDirectory.course_id = os.environ.get("DPCOURSE_COURSE_ID", "")
if os.environ.get("DPCOURSE_EXCHANGE"):
    c.Exchange.root = os.environ["DPCOURSE_EXCHANGE"]

# Released notebooks carry this stub where the solution was.
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
c.ClearSolutions.text_stub = "YOUR ANSWER HERE"

# A cell may run a few launches; each is bounded by the launcher's deadline
# (60 s by default, far less in the tests), so a hung learner function scores 0
# on its cell with a message and autograde always finishes.
c.Execute.timeout = int(os.environ.get("DPCOURSE_CELL_TIMEOUT", TIMEOUTS["cell"]))
c.Execute.interrupt_on_timeout = True
# Demos, benchmarks, widgets and long plots carry the cell tag "demo": grading and `nbgrader
# validate` skip them (no test cell may depend on them), so a notebook grades in seconds.
# A learner's JupyterLab runs them as usual. See docs/authoring.md.
c.Execute.skip_cells_with_tag = "demo"

# Feedback shows the test cells as the learner saw them, never the hidden part: the hidden
# lines are cleared from the source, and tracebacks (which quote the lines around a failure)
# are reduced to the error's message.
c.GenerateFeedback.preprocessors = [
    "nbgrader.preprocessors.ClearHiddenTests",
    "dpgrader.feedback.ScrubTracebacks",
    "nbgrader.preprocessors.GetGrades",
    "nbconvert.preprocessors.CSSHTMLHeaderPreprocessor",
]

# Autograde: the submission's own cells run in a sandboxed kernel (for feedback); every graded
# test cell is judged by dpgrader.judge in a separate process that never runs learner code, and
# its verdict becomes the cell's output that nbgrader scores (dpgrader/judge/steps.py).
# DPCOURSE_SANDBOX=0 (grade.py --no-sandbox) runs the same pipeline without the sandbox.
SANDBOXED = os.environ.get("DPCOURSE_SANDBOX", "1") != "0"
# grade.py and autograde.py judge first, then record with nbgrader: the verdicts are read from
# DPCOURSE_VERDICTS_DIR (no learner code runs while recording). `nbgrader autograde` run by hand or
# from the formgrader judges each notebook itself.
c.Autograde.autograde_preprocessors = [
    JudgedExecute, IgnorePattern, ClearMetadataPreprocessor, LimitOutput,
    SaveAutoGrades, AssignLatePenalties, CheckCellMetadata,
]
c.JudgedExecute.verdicts_dir = os.environ.get("DPCOURSE_VERDICTS_DIR", "")
c.JudgedExecute.source_root = os.path.join(c.CourseDirectory.root, "solutions")
c.JudgedExecute.sandbox = SANDBOXED
# The judge gives every grade. Running the submission's own (non-test, non-demo) cells in the
# sandboxed kernel as well only adds their outputs to the feedback, and costs a kernel per notebook:
# off unless DPCOURSE_RUN_KERNEL=1.
c.JudgedExecute.run_submission = os.environ.get("DPCOURSE_RUN_KERNEL", "0") == "1"
if SANDBOXED:
    c.JudgedExecute.kernel_name = KERNEL_NAME
    spec_folder = kernelspec(pathlib.Path(work) / ".jupyter")
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(spec_folder),
                                                               os.environ.get("JUPYTER_PATH")]))
