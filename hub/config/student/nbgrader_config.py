"""nbgrader's configuration for a student of a class on the course's JupyterHub (`make hub`).

hub/setup_class.py copies this folder into the class's config folder, which the hub puts on every
student's JUPYTER_CONFIG_PATH (the students cannot read hub/). Students never load the course's own
configuration (autograder/nbgrader_config.py): it imports the hidden checks, closed to them.
"""

import importlib.util
import os
import runpy
import stat

from nbgrader.exchange.default.submit import ExchangeSubmit

c = get_config()  # noqa: F821 - provided by traitlets when it loads this file

# the class's exchange; the hub sets both for every server it starts
c.CourseDirectory.course_id = os.environ["DPCOURSE_COURSE_ID"]
c.Exchange.root = os.environ["DPCOURSE_EXCHANGE"]

# Validate runs the notebook as the course's grader does: demo cells skipped, the course's cell timeout
# (read from the course's one table of timeouts without importing dpcourse, which imports torch)
library = importlib.util.find_spec("dpcourse").submodule_search_locations[0]
TIMEOUTS = runpy.run_path(os.path.join(library, "runtime", "timeouts.py"))["TIMEOUTS"]
c.Execute.timeout = int(TIMEOUTS["cell"])
c.Execute.interrupt_on_timeout = True
c.Execute.skip_cells_with_tag = "demo"


class PrivateSubmit(ExchangeSubmit):
    """nbgrader's submit, but the copy left in the exchange is for the instructor only.

    nbgrader's own leaves a submission readable by every user (its folder 0777, its files 0644): only
    the folder's name, which ends in a random string, hides it. Here the folder keeps no permission
    for others, so nothing in it can be reached; it belongs to the inbound folder's group (the
    instructor's: nbgrader makes inbound set-group-ID), which is how the instructor's `collect` reads it.
    """

    def copy_files(self):
        super().copy_files()  # ends with chmod 0777 on the submission's folder
        folder = os.path.join(self.inbound_path, self.assignment_filename)
        os.chmod(folder, stat.S_IRWXU | stat.S_IRWXG)


c.ExchangeFactory.submit = PrivateSubmit
