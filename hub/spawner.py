"""The hub's spawner: JupyterHub's LocalProcessSpawner (each user's server is a process of that system
user, in their home), which first makes the course's Python runnable by that user.

Why: `make install` makes .venv from whatever `python3` is, and .venv runs that interpreter from where
it is installed. Where that is a private folder (pyenv under /root, mode 0700, on these machines), no
other user can start .venv's Python at all. So each server starts in a mount namespace of its own in
which every such folder on the way to the interpreter (here /root) is an empty read-only folder that
holds only the interpreter's installation, read-only. Nothing else differs from outside: the same
files with the same owners and permissions, which is what keeps users apart (setup_class.py). Where
the interpreter is installed for everyone (/usr/bin/python3), no namespace is made.
"""

import ctypes
import os
import sys
from pathlib import Path

from jupyterhub.spawner import LocalProcessSpawner, set_user_setuid

CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1, 2, 4, 32, 4096, 16384, 1 << 18)
_libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the code below runs between fork and exec


def interpreter():
    """The installation of the Python that .venv runs (sys.base_prefix, links resolved)."""
    return Path(sys.base_prefix).resolve()


def hidden_by(path):
    """The top-most folder above `path` that other users may not pass through, or None."""
    for folder in reversed(path.parents):
        if not os.stat(folder).st_mode & 0o001:
            return folder
    return None


def _check(result, what):
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source, target, fstype, flags, data=None):
    _check(_libc.mount(source and source.encode(), str(target).encode(), fstype and fstype.encode(),
                       flags, data and data.encode()), f"mount {target}")


def show_interpreter(path, blocker):
    """In a new mount namespace (this process and its children only): `blocker` becomes a read-only
    tmpfs holding only `path`, bound read-only from the real one."""
    _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here reaches the rest of the machine
    real = os.open(path, os.O_PATH | os.O_DIRECTORY)  # the real folder, before the tmpfs covers it
    try:
        _mount("tmpfs", blocker, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k")
        os.makedirs(path, mode=0o755, exist_ok=True)
        _mount(f"/proc/self/fd/{real}", path, None, MS_BIND | MS_REC)
        _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
        _mount(None, blocker, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    finally:
        os.close(real)


def preexec_for(name):
    """What runs in a server of user `name` between fork and exec: the namespace (if needed), then
    JupyterHub's own switch to the user (groups, uid, home as working folder)."""
    become_user = set_user_setuid(name)
    path = interpreter()
    blocker = hidden_by(path)
    if blocker is None:
        return become_user

    def preexec():
        show_interpreter(path, blocker)  # as root, before the process becomes its user
        become_user()

    return preexec


def environment(klass, name):
    """The variables a server of `name` gets besides JupyterHub's own: students get the class's exchange
    and their nbgrader settings (config/student); the instructor gets the course's own nbgrader
    configuration (autograder/nbgrader_config.py) on the class's course root."""
    env = {"DPCOURSE_COURSE_ID": klass["course_id"], "DPCOURSE_EXCHANGE": klass["exchange"]}
    config = Path(klass["config"])
    if name == klass["instructor"]:
        paths = [config / "instructor", Path(klass["repo"]) / "autograder"]
        env.update(JUPYTER_CONFIG_PATH=os.pathsep.join(map(str, paths)),
                   DPCOURSE_COURSE_ROOT=klass["course_root"], DPCOURSE_REPO=klass["repo"])
    else:
        env.update(JUPYTER_CONFIG_PATH=str(config / "student"))
    return env


class ClassSpawner(LocalProcessSpawner):
    """LocalProcessSpawner, with the course's Python shown to the server (module docstring)."""

    def make_preexec_fn(self, name):
        return preexec_for(name)
