"""nbgrader's configuration for a student of a class on the course's JupyterHub (`make hub`).

hub/setup_class.py copies this folder into the class's config folder, which the hub puts on every
student's JUPYTER_CONFIG_PATH (the students cannot read hub/). Students never load the course's own
configuration (autograder/nbgrader_config.py): it imports the hidden checks, closed to them.
"""

import importlib.util
import os
import runpy
import stat
import sys

c = get_config()  # noqa: F821 - provided by traitlets when it loads this file
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the class's config/

import exchange_rules  # noqa: E402
import student_files  # noqa: E402

# the class's course; the hub sets it for every server it starts
c.CourseDirectory.course_id = os.environ["DPCOURSE_COURSE_ID"]

# Validate runs the notebook as the course's grader does: demo cells skipped, the course's cell timeout
# (read from the course's one table of timeouts without importing dpcourse, which imports torch)
library = importlib.util.find_spec("dpcourse").submodule_search_locations[0]
TIMEOUTS = runpy.run_path(os.path.join(library, "runtime", "timeouts.py"))["TIMEOUTS"]
c.Execute.timeout = int(TIMEOUTS["cell"])
c.Execute.interrupt_on_timeout = True
c.Execute.skip_cells_with_tag = "demo"


if exchange_rules.kind() == "ngshare":
    exchange_rules.use_ngshare(c)
else:
    from nbgrader.exchange.default.fetch_assignment import ExchangeFetchAssignment
    from nbgrader.exchange.default.fetch_feedback import ExchangeFetchFeedback
    from nbgrader.exchange.default.list import ExchangeList
    from nbgrader.exchange.default.submit import ExchangeSubmit

    c.Exchange.root = os.environ["DPCOURSE_EXCHANGE"]

    class PrivateSubmit(exchange_rules.CourseFolderRoot, ExchangeSubmit):
        """nbgrader's submit, but the copy left in the exchange is for the instructor only.

        nbgrader's own leaves a submission readable by every user (its folder 0777, its files 0644): only
        the folder's name, which ends in a random string, hides it. Here the folder keeps no permission
        for others, so nothing in it can be reached; it belongs to the inbound folder's group (the
        instructor's: nbgrader makes inbound set-group-ID), which is how the instructor's `collect` reads
        it.
        """

        def copy_files(self):
            super().copy_files()  # ends with chmod 0777 on the submission's folder
            folder = os.path.join(self.inbound_path, self.assignment_filename)
            os.chmod(folder, stat.S_IRWXU | stat.S_IRWXG)

    class OwnFetchFeedback(exchange_rules.CourseFolderRoot, ExchangeFetchFeedback):
        """nbgrader's fetch-feedback, taking from the exchange only what the instructor released there:
        regular files owned by the owner of its feedback folder (the instructor), none through a link."""

        def do_copy(self, src, dest):
            releaser = os.stat(self.outbound_path).st_uid
            for notebook_id, timestamp, feedback in self.feedback_files:
                folder = os.path.join(dest, timestamp)
                os.makedirs(folder, exist_ok=True)
                target = os.path.join(folder, notebook_id + ".html")
                try:
                    student_files.copy_file(feedback, target, releaser)
                except (student_files.Refused, OSError) as exc:
                    self.log.error(f"feedback {os.path.basename(feedback)} not fetched: {exc}")
                    continue
                self.log.info(f"Fetched feedback: {target}")

    class CourseFetchAssignment(exchange_rules.CourseFolderRoot, ExchangeFetchAssignment):
        pass

    class CourseList(exchange_rules.CourseFolderRoot, ExchangeList):
        pass

    c.ExchangeFactory.submit = PrivateSubmit
    c.ExchangeFactory.fetch_feedback = OwnFetchFeedback
    c.ExchangeFactory.fetch_assignment = CourseFetchAssignment
    c.ExchangeFactory.list = CourseList
