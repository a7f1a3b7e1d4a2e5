"""The grading sandbox: what a process running learner code can see, and how much it may use.

Built on bubblewrap (`bwrap`, Debian's `bubblewrap`): a new mount namespace that holds only the
operating system's programs and libraries (read-only), the Python environment (read-only) and
the released course (read-only), with a private /tmp of limited size as the only writable
place; a new pid namespace whose processes all die with the sandbox (daemons included); no
network at all; no capabilities (so no limit can be raised from inside). Not visible: the
solutions, the hidden checks, the gradebook, other students' submissions, the git history.

Limits: processes and memory through a cgroup per sandbox when /sys/fs/cgroup/{pids,memory} is
writable (as root on Linux), plus rlimits (open files, file size, core dumps, each process's data
memory) in every case;
time is bounded by whoever waits for the sandbox (launch deadlines, nbgrader's cell timeout).

`require()` refuses to go on, with a message saying how to fix it, where bwrap is missing or
cannot start: grading never falls back silently to an unsandboxed run (a learner grading their
own copy may opt out explicitly: `grade.py --no-sandbox`).
"""

import os
import resource
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[3]
COURSE = REPO / "course"
LIMITS = {
    "scratch_bytes": 512 << 20,  # the judge's scratch folder (a tmpfs, as root), shared with its ranks
    "judge_memory_bytes": 4 << 30,  # of a judge process (it holds what ranks send it)
    "judge_pids": 256,
    "tmp_bytes": 512 << 20,  # the private /tmp
    "shm_bytes": 64 << 20,  # the private /dev/shm (as root each rank mounts its own, of the same size)
    "file_bytes": 256 << 20,  # largest file a process may write
    "open_files": 1024,
    "pids": 512,  # processes and threads of one sandbox (up to 8 ranks and their library threads)
    "memory_bytes": 8 << 30,  # of one sandbox
}
# DPCOURSE_SANDBOX_MEMORY / DPCOURSE_SANDBOX_PIDS override the last two (the tests of hostile
# submissions use small ones, to reach them quickly).
LIMITS["memory_bytes"] = int(os.environ.get("DPCOURSE_SANDBOX_MEMORY", LIMITS["memory_bytes"]))
LIMITS["pids"] = int(os.environ.get("DPCOURSE_SANDBOX_PIDS", LIMITS["pids"]))
LIMITS["judge_memory_bytes"] = int(os.environ.get("DPCOURSE_JUDGE_MEMORY", LIMITS["judge_memory_bytes"]))
LIMITS["scratch_bytes"] = int(os.environ.get("DPCOURSE_SANDBOX_SCRATCH", LIMITS["scratch_bytes"]))
CGROUP_ROOT = Path("/sys/fs/cgroup")
# The whole environment of a sandbox: nothing of the instructor's (a secret in the grader's
# environment, DPCOURSE_DB_URL, the course root) reaches learner code. HOME, TMPDIR and MPLCONFIGDIR
# are set by `argv` (the private /tmp).
ENVIRONMENT = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
               "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(COURSE),
               "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MPLBACKEND": "Agg"}


def environment(**extra):
    """A sandbox's environment: ENVIRONMENT and `extra`, nothing inherited."""
    return dict(ENVIRONMENT, **extra)


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run here; the message says what to install or change."""


def require():
    """Raise SandboxUnavailable unless a sandbox starts and runs Python here."""
    under_tmp = [str(p) for p in (COURSE, Path(sys.prefix), Path(sys.prefix).resolve())
                 if Path("/tmp") in p.parents]
    if under_tmp:
        raise SandboxUnavailable(
            f"the course or its Python environment lives under /tmp ({under_tmp[0]}), and every graded "
            f"rank gets a private /tmp that would hide it: clone the course elsewhere (e.g. ~/dpcourse), "
            f"run `make install` there, and grade from that copy")
    if shutil.which("bwrap") is None:
        raise SandboxUnavailable(
            "grading runs learner code in a sandbox made with bubblewrap, which is not installed: "
            "run `sudo make sandbox-deps` (or `sudo apt-get install -y bubblewrap`). To grade your "
            "own notebook without it, pass --no-sandbox (the report then says it was not sandboxed).")
    # Python starts in a sandbox and finds torch there (not imported: that takes seconds, and
    # grading starts only after this check)
    find_torch = ("import importlib.util, sys; "
                  "sys.exit(importlib.util.find_spec('torch') is None and 'torch is not visible')")
    probe = subprocess.run(argv([sys.executable, "-c", find_torch]), capture_output=True, text=True,
                           timeout=120)
    if probe.returncode != 0:
        raise SandboxUnavailable(
            f"bubblewrap is installed but a sandbox could not start ({probe.stderr.strip()[-300:]}); "
            f"it needs user namespaces or root (`sysctl kernel.unprivileged_userns_clone=1`), or "
            f"pass --no-sandbox to grade your own notebook unsandboxed")


def argv(command, *, binds=(), network=False, keep_capabilities=False):
    """The bwrap command line that runs `command` in a fresh sandbox.

    binds: extra (path, writable) pairs to show inside at the same place (a kernel's
    connection file). network=True keeps the host's loopback (a Jupyter kernel, which its
    client reaches over TCP); graded ranks get no network at all. keep_capabilities: for the
    grader's own warm interpreter, which isolates each rank it forks and then drops root
    before any learner code runs (dpcourse.grading.zygote.isolate).
    """
    base, prefix = Path(sys.base_prefix).resolve(), Path(sys.prefix)
    args = ["bwrap", "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-ipc",
            "--unshare-uts", "--unshare-cgroup-try"]
    if not keep_capabilities:
        args += ["--cap-drop", "ALL"]
    if not network:
        args.append("--unshare-net")
    for path in ("/usr", "/lib", "/lib64", "/bin", "/sbin", "/etc"):
        args += ["--ro-bind-try", path, path]
    shown = sorted({base, prefix, prefix.resolve(), COURSE})
    extra = [Path(path) for path, _ in binds]
    parents = sorted({a for p in shown + extra for a in p.parents if str(a) != "/"} - set(shown + extra),
                     key=lambda a: len(a.parts))
    # the private /tmp first, then what is shown: a course or an environment that lives under /tmp
    # (a clone in /tmp/...) stays visible on top of it
    # /dev/shm a tmpfs of its own and bounded (bubblewrap's /dev is a tmpfs of half the machine's memory)
    args += ["--proc", "/proc", "--dev", "/dev", "--size", str(LIMITS["shm_bytes"]), "--perms", "1777",
             "--tmpfs", "/dev/shm", "--size", str(LIMITS["tmp_bytes"]), "--perms", "1777",
             "--tmpfs", "/tmp", "--perms", "1777", "--dir", "/tmp/home", "--setenv", "HOME", "/tmp/home",
             "--setenv", "MPLCONFIGDIR", "/tmp/home",
             "--setenv", "TMPDIR", "/tmp", "--chdir", "/tmp"]
    for parent in parents:  # traversable by the unprivileged users that graded ranks run as
        args += ["--perms", "0755", "--dir", str(parent)]
    for path in shown:
        args += ["--ro-bind", str(path), str(path)]
    for path, writable in binds:
        args += ["--bind" if writable else "--ro-bind", str(path), str(path)]
    return args + ["--", *map(str, command)]


AUTOGRADER = REPO / "autograder"
HIDDEN_FROM_THE_JUDGE = ("/etc/shadow", "/etc/gshadow", "/etc/sudoers", "/etc/ssh")
# What the judge keeps of root's capabilities, and why: the ranks' sandboxes (namespaces, mounts:
# SYS_ADMIN, SYS_CHROOT; their loopback: NET_ADMIN; their capability sets: SETPCAP), each rank's own
# user (SETUID, SETGID; its home's owner: CHOWN), signalling processes of other users (KILL), and
# the cgroup tree, whose folders are read-only to everyone, root included (DAC_OVERRIDE: harmless
# here, the judge's mount namespace shows only what it needs). Not kept: tracing processes
# (SYS_PTRACE), raw I/O, modules, devices, the clock, the network's raw sockets, ...
JUDGE_CAPABILITIES = ("CAP_SYS_ADMIN", "CAP_SYS_CHROOT", "CAP_NET_ADMIN", "CAP_SETPCAP", "CAP_SETUID",
                      "CAP_SETGID", "CAP_CHOWN", "CAP_KILL", "CAP_DAC_OVERRIDE")


def judge_argv(command, folder, scratch):
    """The bwrap command line of a judge process: it sees the OS, the Python environment, the
    released course and the grader's own package (autograder/dpgrader, with the hidden checks), all
    read-only; its own folder (`folder`: the notebooks of the job it is given, its log) and the
    scratch folder it shares with its ranks, writable; and the cgroup hierarchy, where it makes each
    submission's cgroup. Not the gradebook, not other students' submissions, not the solutions
    (the job's own notebook is copied into `folder`), not the instructor's home. It keeps the few
    capabilities of root it needs (JUDGE_CAPABILITIES): it starts the ranks' sandboxes and gives
    each rank a user of its own; no learner code ever runs in it (dpgrader.judge.cells)."""
    base, prefix = Path(sys.base_prefix).resolve(), Path(sys.prefix)
    args = ["bwrap", "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-ipc",
            "--unshare-uts", "--unshare-net", "--cap-drop", "ALL"]
    for capability in JUDGE_CAPABILITIES:
        args += ["--cap-add", capability]
    for path in ("/usr", "/lib", "/lib64", "/bin", "/sbin", "/etc"):
        args += ["--ro-bind-try", path, path]
    for path in HIDDEN_FROM_THE_JUDGE:  # root-only files of the OS: emptied
        if os.path.isdir(path):
            args += ["--tmpfs", path]
        elif os.path.exists(path):
            args += ["--ro-bind", "/dev/null", path]
    args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--setenv", "TMPDIR", "/tmp",
             "--chdir", str(folder)]
    for path in sorted({base, prefix, prefix.resolve(), COURSE, AUTOGRADER / "dpgrader"}):
        args += ["--ro-bind", str(path), str(path)]
    for path in (folder, scratch, CGROUP_ROOT):
        args += ["--bind", str(path), str(path)]
    return args + ["--", *map(str, command)]


UID_BLOCK = 128  # user ids per submission: its ranks (up to 64) and its learner process of direct calls


def new_uid_block():
    """The first of UID_BLOCK user ids nobody else uses: fresh for each submission (and each sandboxed
    kernel), so that nothing one learner's processes do (signals, per-user limits) can reach
    another's. Drawn at random from 2^20 .. 2^31, far from the machine's own users; two submissions
    meet with a chance of 1 in 2^24."""
    import secrets

    return secrets.randbelow((1 << 31) // UID_BLOCK - (1 << 20) // UID_BLOCK) * UID_BLOCK + (1 << 20)


def can_isolate_ranks():
    """Ranks can share one sandbox, each isolated by the zygote, when we are really root
    (DPCOURSE_SANDBOX_SHARED=0 forces one sandbox per rank, as a user without root gets)."""
    return os.geteuid() == 0 and os.environ.get("DPCOURSE_SANDBOX_SHARED", "1") != "0"


def remove_stale_cgroups():
    """Remove the empty cgroups that finished sandboxes left (a kernel's cgroup outlives it)."""
    for controller in ("pids", "memory"):
        for path in (CGROUP_ROOT / controller).glob("dpcourse-*"):
            try:
                for child in path.glob("rank*"):  # a measured rank's memory cgroup (RankMemory)
                    child.rmdir()
                path.rmdir()
            except OSError:
                pass


def mount_tmpfs(path, size):
    """Mount a tmpfs of `size` bytes at `path` (an empty folder), writable by everyone; False where
    this process may not mount (not root): the folder then stays a plain one, bounded per file only."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    options = f"size={int(size)},mode=0777".encode()
    return libc.mount(b"tmpfs", os.fsencode(path), b"tmpfs", 2 | 4, options) == 0  # nosuid, nodev


def unmount(path):
    """Detach whatever is mounted at `path` (lazily: it goes once nothing uses it)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).umount2(os.fsencode(path), 2)  # MNT_DETACH


def set_rlimits():
    """preexec_fn of a sandbox: limits that no process inside can raise (it has no capabilities).
    RLIMIT_DATA (a process's heap and private writable mappings) bounds each process's memory where no
    cgroup bounds the sandbox's (grading without root), and is no tighter than the cgroup where one does."""
    for limit, value in ((resource.RLIMIT_NOFILE, LIMITS["open_files"]),
                         (resource.RLIMIT_FSIZE, LIMITS["file_bytes"]), (resource.RLIMIT_CORE, 0),
                         (resource.RLIMIT_DATA, LIMITS["memory_bytes"])):
        resource.setrlimit(limit, (value, value))


class Cgroup:
    """A pids + memory cgroup (v1) for one sandbox, one submission or one judge, removed when it ends.

    Limits are per cgroup, not per machine user: what one learner's processes use counts against
    that learner's submission only. `memory` and `pids` default to LIMITS (a sandbox's).
    """

    def __init__(self, memory=None, pids=None, name="dpcourse"):
        self.paths = []
        name = f"{name}-{uuid.uuid4().hex[:12]}"
        v1 = [(CGROUP_ROOT / "pids", {"pids.max": pids or LIMITS["pids"]}),
              (CGROUP_ROOT / "memory", {"memory.limit_in_bytes": memory or LIMITS["memory_bytes"],
                                        "memory.memsw.limit_in_bytes": None})]
        for controller, settings in v1:
            if not os.access(controller, os.W_OK):
                continue
            path = controller / name
            try:
                path.mkdir()
                for key, value in settings.items():
                    if value is not None:
                        (path / key).write_text(str(value))
            except OSError:
                continue
            self.paths.append(path)

    @property
    def enforced(self):
        return {p.parent.name for p in self.paths}

    def add(self, pid):
        for path in self.paths:
            try:
                (path / "cgroup.procs").write_text(str(pid))
            except OSError:
                pass

    def pids(self):
        """The processes in it (pids as this process sees them)."""
        for path in self.paths:
            try:
                return [int(line) for line in (path / "cgroup.procs").read_text().split()]
            except OSError:
                continue
        return []

    def kill_all(self, timeout=5.0):
        """SIGKILL every process in it, until none is left (a fork racing the kill is caught next round)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            pids = self.pids()
            if not pids:
                return True
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.005)
        return False

    def limits_reached(self):
        """{"processes": times a fork or thread hit pids.max, "memory": times an allocation hit the
        memory limit}: how a submission that failed on "can't start new thread" or a kill is told
        apart from one hurt by something else."""
        found = {}
        for path in self.paths:
            try:
                if path.parent.name == "pids":
                    events = (path / "pids.events").read_text().split()
                    found["processes"] = int(events[events.index("max") + 1]) if "max" in events else 0
                else:
                    found["memory"] = int((path / "memory.failcnt").read_text())
            except (OSError, ValueError, IndexError):
                continue
        return found

    def oom_kills(self):
        """How many of its processes the kernel's OOM killer killed (memory.oom_control: oom_kill); with its
        own limit not reached (memory_failures 0), the machine ran out of memory, not the submission."""
        for path in self.paths:
            if path.parent.name == "memory":
                return RankMemory.oom_kills(SimpleNamespace(path=path))
        return 0

    def memory_failures(self):
        """How many times an allocation hit its memory limit (memory.failcnt), or None."""
        for path in self.paths:
            if path.parent.name == "memory":
                try:
                    return int((path / "memory.failcnt").read_text())
                except (OSError, ValueError):
                    return None
        return None

    def memory_child(self, name):
        """A memory cgroup inside this one (RankMemory), or None where this one has no memory controller."""
        memory = next((p for p in self.paths if p.parent.name == "memory"), None)
        if memory is None:
            return None
        try:
            return RankMemory(memory / name)
        except OSError:
            return None

    def remove(self):
        for path in self.paths:
            for child in [c for c in path.iterdir() if c.is_dir()] if path.is_dir() else []:
                _rmdir(child)  # a rank's memory cgroup the launch did not remove (it was killed)
            _rmdir(path)


def _rmdir(path):
    for _ in range(100):  # a killed process leaves its cgroup a moment after it dies
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)


class RankMemory:
    """One rank's own memory cgroup, inside its submission's (which still limits it): everything the rank
    and the processes it starts hold is charged here (anonymous memory, shared mappings, its tmpfs files,
    memfds, pipe buffers, kernel memory), which its zygote reads at the moments the run names (what
    of it counts: dpcourse.grading.zygote.Probe). The rank enters it itself, first thing after it is
    forked, through `fds()`'s cgroup.procs (opened here, as root: cgroup v1 checks the opener's
    credentials)."""

    def __init__(self, path):
        self.path = path
        path.mkdir()

    FILES = (("cgroup.procs", os.O_WRONLY), ("memory.stat", os.O_RDONLY), ("memory.kmem.usage_in_bytes",
                                                                            os.O_RDONLY))

    def fds(self):
        """The files its zygote needs, opened here (cgroup.procs to enter it; memory.stat and its kernel
        memory to measure it: dpcourse.grading.zygote.Probe), in that order; close them after."""
        opened = []
        try:
            for name, mode in self.FILES:
                opened.append(os.open(self.path / name, mode | os.O_CLOEXEC))
        except OSError:
            for fd in opened:
                os.close(fd)
            raise
        return opened

    def oom_kills(self):
        """How many of its processes the kernel's OOM killer killed (memory.oom_control: oom_kill)."""
        try:
            for line in (self.path / "memory.oom_control").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def remove(self):
        _rmdir(self.path)


def start(command, *, binds=(), network=False, keep_capabilities=False, pass_fds=(), **popen):
    """Start `command` in a sandbox; return (Popen, Cgroup). Call `cgroup.remove()` after it ends.

    The new process joins the cgroup before it runs bwrap (in preexec_fn), so every process of
    the sandbox is counted from the first.
    """
    cgroup = Cgroup()

    def prepare():
        set_rlimits()
        cgroup.add(os.getpid())

    proc = subprocess.Popen(argv(command, binds=binds, network=network, keep_capabilities=keep_capabilities),
                            pass_fds=pass_fds, preexec_fn=prepare, **popen)
    return proc, cgroup
