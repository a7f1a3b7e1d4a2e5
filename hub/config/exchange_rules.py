"""The class's rules for nbgrader's exchange, shared by both roles' configurations (hub/config/*/).

With the filesystem exchange (`make hub`, EXCHANGE=filesystem) nbgrader wants its root writable by
everyone (1777), so that whoever releases first makes the course's folder; then any student can make
folders there too, claiming another course's name before its instructor does (issue 28). Here the root
belongs to root and lets nobody write (0755), and setup_class.py makes the class's own course folder in
it, owned by the instructor. `CourseFolderRoot` makes nbgrader's classes check that folder instead of
the root (and never chmod the root, as nbgrader's release would).

With ngshare (EXCHANGE=ngshare) there is no shared folder: `ngshare_classes` configures
ngshare-exchange's classes for every role (submissions are uploaded as bytes, under the identity of the
uploader's JupyterHub token).
"""

import os

from nbgrader.utils import check_directory


class CourseFolderRoot:
    """Mixin for nbgrader's filesystem exchange classes: the exchange root is the machine's (root, 0755);
    what must exist and be usable is the course's folder in it (made by setup_class.py)."""

    def ensure_root(self):
        course = os.path.join(self.root, self.coursedir.course_id)
        if not check_directory(course, read=True, execute=True):
            self.fail(f"The course's folder in the exchange is missing or closed to you ({course}): "
                      "please contact your instructor")


def kind():
    """'filesystem' or 'ngshare': what the hub set for this class (class.json, DPCOURSE_EXCHANGE_KIND)."""
    return os.environ.get("DPCOURSE_EXCHANGE_KIND", "filesystem")


def use_ngshare(c):
    """Every role's exchange classes from ngshare-exchange, talking to the class's ngshare service."""
    import ngshare_exchange

    ngshare_exchange.configureExchange(c, os.environ["DPCOURSE_NGSHARE_URL"])
