"""nbgrader's own steps, run in this process, recording verdicts the judge gave beforehand.

    book = Recorder(root, db_url, verdicts_dir, sandboxed=True)
    book.generate("00_orientation")                 # the assignment's cells into the gradebook
    book.autograde("00_orientation", exclude=[...]) # submissions scored from their verdicts
    book.feedback("00_orientation", exclude=[...])  # feedback without the hidden tests
    book.export(root / "autograder" / "grades.csv")

Why in this process: `python -m nbgrader` costs ~3 s to start here, and recording is a fraction
of a second per step once started; a class run used to start it three times per assignment.
The configuration is the course's own (autograder/nbgrader_config.py), read once, with
`JudgedExecute` taking each notebook's verdicts from `verdicts_dir` (see steps.py): no learner
code runs while recording, unless DPCOURSE_RUN_KERNEL=1 asks for the kernel's outputs.
"""

import os
import sys
import warnings
from pathlib import Path

AUTOGRADER = Path(__file__).resolve().parents[2]

# jsonschema, which nbformat loads to validate notebooks, imports `rfc3987_syntax` when it is
# installed (it is, through jupyter's event schemas) to check "iri" string formats, and that module
# compiles a grammar at import: 1.1 s of every grading run. Notebook schemas use no string formats,
# so recording never needs it; Jupyter's own processes are not affected.
sys.modules.setdefault("rfc3987_syntax", None)


class Recorder:
    """nbgrader's API on one course root and gradebook; each step returns its log (errors listed)."""

    def __init__(self, root, db_url, verdicts_dir, sandboxed=True, submitted=None):
        """`submitted`: the folder (relative to `root`) nbgrader takes submissions from, instead of
        autograder/submitted: autograde.py's copy of it, made of regular files only (dpgrader.safe_copy)."""
        # the configuration file reads these when it is loaded (as it does under `python -m nbgrader`);
        # without a db_url it uses its own default (autograder/gradebook.db of the course root)
        os.environ.update(DPCOURSE_COURSE_ROOT=str(root), DPCOURSE_VERDICTS_DIR=str(verdicts_dir),
                          DPCOURSE_SANDBOX=str(int(sandboxed)))
        if db_url:
            os.environ["DPCOURSE_DB_URL"] = db_url
        # nbgrader creates a gradebook with the `alembic` command, from the environment's bin folder
        os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        from nbgrader.apps import NbGraderAPI
        from nbgrader.coursedir import CourseDirectory
        from sqlalchemy.exc import SAWarning
        from traitlets.config.loader import PyFileConfigLoader

        # nbgrader's own session handling warns on every autograde (api.py, "not in session"): noise
        warnings.filterwarnings("ignore", category=SAWarning, module=r"nbgrader\.")
        config = PyFileConfigLoader("nbgrader_config.py", path=str(AUTOGRADER)).load_config()
        if submitted is not None:
            config.CourseDirectory.submitted_directory = str(submitted)
        self.config = config
        self.api = NbGraderAPI(coursedir=CourseDirectory(config=config), config=config)

    def generate(self, assignment):
        return self._step(self.api.generate_assignment(assignment, force=True), "generate_assignment",
                          assignment)

    def autograde(self, assignment, exclude=()):
        from nbgrader.converters import Autograde

        return self._all_students(Autograde, assignment, exclude, "autograde")

    def feedback(self, assignment, exclude=()):
        from nbgrader.converters import GenerateFeedback
        from traitlets.config import Config

        extra = Config()
        extra.HTMLExporter.template_name = "feedback"  # as nbgrader's API does
        return self._all_students(GenerateFeedback, assignment, exclude, "generate_feedback", extra)

    def export(self, path):
        from nbgrader.api import Gradebook
        from nbgrader.plugins import CsvExportPlugin

        plugin = CsvExportPlugin(config=self.config)
        plugin.to = str(path)
        with Gradebook(self.api.coursedir.db_url, self.api.coursedir.course_id) as gb:
            plugin.export(gb)

    def _all_students(self, converter, assignment, exclude, name, extra=None):
        """One converter over every submission of an assignment but the excluded students."""
        from nbgrader.utils import capture_log, temp_attrs

        coursedir = self.api.coursedir
        with temp_attrs(coursedir, assignment_id=assignment, student_id="*",
                        student_id_exclude=",".join(sorted(exclude))):
            app = converter(coursedir=coursedir, parent=self.api)
            if extra is not None:
                app.update_config(extra)
            app.force = True
            if hasattr(app, "create_student"):
                app.create_student = True
            return self._step(capture_log(app), name, assignment)

    @staticmethod
    def _step(result, name, assignment):
        """The step's log; raises StepFailed when nbgrader reported an error."""
        log = result.get("log", "")
        if not result.get("success"):
            raise StepFailed(f"{assignment}: nbgrader {name} reported errors:\n"
                             + errors_of(log + "\n" + result.get("error", "")))
        return log


class StepFailed(RuntimeError):
    """An nbgrader step ended with an error (its log's error lines are the message)."""


def errors_of(log, lines=15):
    found = [line for line in log.splitlines() if "ERROR" in line or "Error" in line]
    return "\n".join((found or log.splitlines())[-lines:])
