"""ngshare, the class's exchange as a JupyterHub service (`make hub EXCHANGE=ngshare`), as its own user.

    python hub/ngshare_service.py --root HUB_ROOT    # what the hub starts (a managed service), as root
    python ngshare_service.py --serve ARGS...         # the exchange's image on Kubernetes (hub/k8s/)

Started by the hub as root, it becomes the exchange's system user (class.json: exchange_user) the way a
user's server does (hub/spawner.py: the course's Python shown to it, then JupyterHub's own switch of
user), then runs ngshare 0.6.0 on the class's database and files (ROOT/ngshare, that user's only). ngshare
listens on every interface ("Must listen on all interfaces for proxy", ngshare.py); here on 127.0.0.1
only: the students' servers, the proxy and the hub all run on this machine.

ngshare authenticates every request by the JupyterHub API token it carries (`Authorization: token ...`,
checked with the hub's /hub/api/user), so each request is its token's user's: a student's submission
is recorded as theirs whatever they claim, only the course's instructors may list or download
submissions, and a student may read only their own feedback (ngshare.py's handlers).

ngshare 0.6.0 (PyPI's newest, 2022) was written for SQLAlchemy 1.x, where an object linked to one
already in a session (a new Assignment given its Course, a new Submission its Assignment) joined that
session by the backref ("cascade_backrefs"). SQLAlchemy 2 removed that (its 1.4 migration notes, change
5150): with the SQLAlchemy of this environment (2.1) a release or a submission answers "success" and is
never stored ("SAWarning: Object of type <Assignment> not in session, add operation along
'Course.assignments' will not proceed"), so nothing can be fetched or collected. Upstream fixed it
after 0.6.0 (LibreTexts/ngshare fd8467e, 2024-10-09: `self.db.add(assignment)` and
`self.db.add(submission)` in the two handlers), unreleased. Here the same two objects are added to
their parent's session when linked to it (SQLAlchemy attribute events), which is what that fix does.
"""

import argparse
import json
import os
import sys
from pathlib import Path

HUB = Path(__file__).resolve().parent

# What runs ngshare, as the exchange's user (who cannot read hub/: passed as `python -c` code): upstream's
# fix for SQLAlchemy 2 (see the module docstring), then ngshare's own main with the arguments given.
FIXED = """
import sys

import ngshare.ngshare as ngshare
from ngshare.database import Assignment, Submission
from sqlalchemy import event, inspect
from sqlalchemy.orm import configure_mappers


def joins_its_parents_session(target, value, oldvalue, initiator):
    session = inspect(value).session if value is not None else None
    if session is not None and target not in session:
        session.add(target)


configure_mappers()  # the backrefs (Assignment.course, Submission.assignment) exist from here on
for attribute in (Assignment.course, Submission.assignment, Submission.student):
    event.listen(attribute, "set", joins_its_parents_session)
"""
LOOPBACK = """
class Loopback(ngshare.HTTPServer):
    def listen(self, port, address="", **kwargs):
        return super().listen(port, "127.0.0.1", **kwargs)


ngshare.HTTPServer = Loopback
"""
MAIN = """
ngshare.main(sys.argv[1:])
"""


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:  # in the exchange's container image (hub/k8s/Dockerfile): ngshare's own args
        os.execv(sys.executable, [sys.executable, "-c", FIXED + MAIN, *argv[1:]])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, required=True, help="the class's folder (make hub's HUB_ROOT)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    klass = json.loads((root / "hub" / "class.json").read_text())
    folder = root / "ngshare"
    command = [sys.executable, "-c", FIXED + LOOPBACK + MAIN,
               "--database", f"sqlite:///{folder / 'ngshare.db'}", "--storage", str(folder / "files")]
    sys.path.insert(0, str(HUB))
    from spawner import preexec_for

    os.chdir(folder)
    preexec_for(klass["exchange_user"])()  # as root: the interpreter shown, then the exchange's user
    os.execv(sys.executable, command)


if __name__ == "__main__":
    sys.exit(main())
