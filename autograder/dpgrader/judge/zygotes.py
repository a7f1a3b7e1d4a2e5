"""The grading sandboxes' warm interpreters (zygotes), and starting them before the judge loads torch.

A zygote is one sandbox holding an interpreter with torch imported, which forks a rank per launch
(dpcourse.grading.zygote is its inside). Starting one costs 2-3 s (bubblewrap, Python, torch), as
long as the judge's own imports: `python -m dpgrader.judge` calls `start_early` first, then loads
the judge, whose RankPool takes the zygotes already warming (`take_early`). Nothing here imports
torch.
"""

import contextlib
import getpass
import json
import os
import socket
import sys
import tempfile
import time

from dpgrader.judge import sandbox

PRESTART = 4  # sandboxes started at once when ranks do not share one (most tests use <= 4 ranks)
_early = None  # {"sandboxed", "scratch", "zygotes"} from start_early, until a RankPool takes them


def start_early(sandboxed):
    """Start the zygotes a judge will need (and its shared scratch folder) now, in the background."""
    global _early
    scratch = shared_scratch()
    shared = sandboxed and sandbox.can_isolate_ranks()
    count = 1 if shared else PRESTART
    _early = {"sandboxed": sandboxed, "scratch": scratch,
              "zygotes": [Zygote(sandboxed, shared, scratch) for _ in range(count)]}


def take_early(sandboxed, scratch):
    """The zygotes start_early began, if they were made for this pool (same sandboxing, same scratch)."""
    global _early
    early, _early = _early, None
    if early and early["sandboxed"] == sandboxed and early["scratch"] == scratch:
        return early["zygotes"]
    for zygote in (early or {}).get("zygotes", []):
        zygote.close()
    return None


def new_scratch_folder():
    """An empty folder outside /tmp (which each rank has to itself), for a judge's shared scratch."""
    return tempfile.mkdtemp(prefix="dpcourse-judge-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)


def shared_scratch():
    """A folder the judge and the ranks both see (outside /tmp, which each rank has to itself).

    Test cells make their temporary folders here (a checkpoint folder rank 0 writes and the
    test reads back): tempfile in this process points at it, and the folders it makes are
    writable by the unprivileged users the ranks run as. A judge started by process.py is given
    the folder (DPCOURSE_JUDGE_SCRATCH), so that it is removed even when the judge is killed.
    """
    if _early is not None:
        return _early["scratch"]
    scratch = os.environ.get("DPCOURSE_JUDGE_SCRATCH")  # made, and removed, by whoever started us
    if scratch:
        os.makedirs(scratch, exist_ok=True)
    else:
        scratch = new_scratch_folder()
    os.chmod(scratch, 0o777)
    # torch's compiler keeps its cache under the temporary folder: where it would be without us,
    # not in the scratch folder (created there, it could outlive the scratch folder's removal)
    with contextlib.suppress(KeyError, OSError):  # getpass: a user without a name
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(),
                                                                       f"torchinductor_{getpass.getuser()}"))
    tempfile.tempdir = scratch
    original = tempfile.mkdtemp

    def shared_mkdtemp(*args, **kwargs):
        path = original(*args, **kwargs)
        os.chmod(path, 0o777)
        return path

    tempfile.mkdtemp = shared_mkdtemp
    return scratch


class GraderFailure(Exception):
    """The grader itself failed (a sandbox did not start): no verdict may be given, grading stops.
    Not an Exception a test cell catches as a learner's failure: the judge re-raises it."""


class Zygote:
    """One sandbox with a warm interpreter that forks the rank of each launch."""

    def __init__(self, sandboxed, shared=False, scratch=None):
        self.control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        command = [os.path.abspath(sys.executable), "-m", "dpcourse.grading.zygote", str(theirs.fileno())]
        if sandboxed:
            command.append("--sandboxed")
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        for key in ("DPCOURSE_COURSE_ROOT", "DPCOURSE_DB_URL", "NBGRADER_EXECUTION", "JPY_SESSION_NAME"):
            env.pop(key, None)
        if sandboxed:
            binds = [(scratch, True)] if scratch else []
            self.proc, self.cgroup = sandbox.start(command, pass_fds=[theirs.fileno()], env=env, binds=binds,
                                                   keep_capabilities=shared, stdin=subprocess_devnull())
        else:
            import subprocess

            self.proc = subprocess.Popen(command, pass_fds=[theirs.fileno()], env=env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
            self.cgroup = None
        theirs.close()
        self.exits, self.ready = {}, False

    def wait_ready(self, timeout=120.0):
        self.control.settimeout(timeout)
        try:
            packet = self.control.recv(4096)
        except TimeoutError:
            packet = b""
        finally:
            self.control.settimeout(None)
        if not packet:
            raise GraderFailure(f"the grading sandbox did not start (exit status {self.proc.poll()})")
        self.ready = True

    def run(self, spec, fds, payload):
        message = json.dumps(dict(spec, cmd="run", size=len(payload))).encode()
        socket.send_fds(self.control, [message], fds)
        for start in range(0, len(payload), 64 * 1024):
            self.control.send(payload[start:start + 64 * 1024])
        return self._read_until(lambda m: "started" in m)["started"]

    def _read_until(self, wanted, timeout=30.0):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.control.settimeout(max(0.01, end - time.monotonic()))
            try:
                packet = self.control.recv(4096)
            except TimeoutError:
                break
            finally:
                self.control.settimeout(None)
            if not packet:
                break
            message = json.loads(packet)
            if "exited" in message:
                self.exits[message["exited"]] = message["status"]
            if wanted(message):
                return message
        raise GraderFailure("the grading sandbox stopped answering")

    def pump(self):
        """Read the zygote's pending messages (exits) without blocking."""
        self.control.setblocking(False)
        try:
            while True:
                packet = self.control.recv(4096)
                if not packet:
                    self.dead = True
                    return
                message = json.loads(packet)
                if "exited" in message:
                    self.exits[message["exited"]] = message["status"]
        except BlockingIOError:
            pass
        finally:
            self.control.setblocking(True)

    def send(self, **message):
        try:
            self.control.send(json.dumps(message).encode())
        except OSError:
            pass

    def close(self):
        self.control.close()
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass
        self.proc.wait()
        if self.cgroup is not None:
            self.cgroup.remove()


def subprocess_devnull():
    import subprocess

    return subprocess.DEVNULL


