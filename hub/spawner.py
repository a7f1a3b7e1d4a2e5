"""The hub's spawner: JupyterHub's LocalProcessSpawner (each user's server is a process of that system
user, in their home), which first makes the course's Python runnable by that user, and puts the server
with everything it starts (kernels, terminals, ranks) in a cgroup of that user's, with the CPU, memory
and process limits of hub/jupyterhub_config.py (Spawner.cpu_limit, Spawner.mem_limit,
ClassSpawner.pids_limit; hub/user_cgroup.py).

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
import pwd
import sys
from pathlib import Path

from jupyterhub.spawner import LocalProcessSpawner, set_user_setuid
from traitlets import Integer
from user_cgroup import PARENT as PARENT_NAME
from user_cgroup import UserCgroup

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


def preexec_for(name, cgroup=None):
    """What runs in a server of user `name` between fork and exec: into the user's cgroup (if given), the
    namespace (if needed), then JupyterHub's own switch to the user (groups, uid, home as working folder)."""
    become_user = set_user_setuid(name)
    path = interpreter()
    blocker = hidden_by(path)

    def preexec():
        if cgroup is not None:
            cgroup.join()  # as root: the user's processes cannot leave it
        if blocker is not None:
            show_interpreter(path, blocker)  # as root, before the process becomes its user
        become_user()

    return preexec


def environment(klass, name):
    """The variables a server of `name` gets besides JupyterHub's own: students get the class's exchange
    and their nbgrader settings (config/student); the instructor gets the course's own nbgrader
    configuration (autograder/nbgrader_config.py) on the class's course root."""
    env = {"DPCOURSE_COURSE_ID": klass["course_id"]}
    if klass.get("exchange_kind", "filesystem") == "filesystem":
        env["DPCOURSE_EXCHANGE"] = klass["exchange"]
    config = Path(klass["config"])
    if name == klass["instructor"]:
        paths = [config / "instructor", Path(klass["repo"]) / "autograder"]
        env.update(JUPYTER_CONFIG_PATH=os.pathsep.join(map(str, paths)),
                   DPCOURSE_COURSE_ROOT=klass["course_root"], DPCOURSE_REPO=klass["repo"])
    else:
        env.update(JUPYTER_CONFIG_PATH=str(config / "student"))
    if klass.get("grading_socket") and name == klass["instructor"]:
        env["DPCOURSE_GRADING_SOCKET"] = klass["grading_socket"]
    if klass.get("exchange_kind"):
        env["DPCOURSE_EXCHANGE_KIND"] = klass["exchange_kind"]
    if klass.get("ngshare_url"):
        env["DPCOURSE_NGSHARE_URL"] = klass["ngshare_url"]
    # torch's compiler keeps its cache in /tmp/torchinductor_<user> unless told: in the user's home, so
    # that nothing of theirs outlives the class in a folder the next user of their uid would inherit
    env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(pwd.getpwnam(name).pw_dir) / ".cache" / "torchinductor")
    return env


class ClassSpawner(LocalProcessSpawner):
    """LocalProcessSpawner, with the course's Python shown to the server and the server in a cgroup of
    its user's with the limits set in the hub's configuration (module docstring)."""

    pids_limit = Integer(None, allow_none=True, config=True,
                         help="most processes and threads a user's server may run at once (kernels, ranks, "
                              "their threads); None: no limit").tag(config=True)

    @property
    def cgroup(self):
        if getattr(self, "_cgroup", None) is None:
            self._cgroup = UserCgroup(self.user.name, memory=self.mem_limit, cpus=self.cpu_limit,
                                      pids=self.pids_limit)
        return self._cgroup

    async def start(self):
        if self.mem_limit or self.cpu_limit or self.pids_limit:
            self.cgroup.create()
            self.log.info(f"{self.user.name}'s server in cgroup {PARENT_NAME}/{self.user.name}: "
                          f"{self.cpu_limit} CPUs, {self.mem_limit} bytes, {self.pids_limit} processes")
        return await super().start()

    def make_preexec_fn(self, name):
        limited = self.mem_limit or self.cpu_limit or self.pids_limit
        return preexec_for(name, self.cgroup if limited else None)

    async def stop(self, now=False):
        await super().stop(now=now)
        # whatever the server left behind (a kernel it did not shut down, a daemon a rank started)
        if self.mem_limit or self.cpu_limit or self.pids_limit:
            self.cgroup.kill_all()
            self.cgroup.remove()
