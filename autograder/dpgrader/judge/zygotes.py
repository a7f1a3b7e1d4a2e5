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

PACKET = 1 << 16  # largest control message a zygote sends (an exit with memory marks: ~20 KB)
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


class ForkRefused(Exception):
    """The kernel refused to fork a rank (EAGAIN: no process or thread left; ENOMEM): seen by the zygote,
    outside the learner's code. The judge tells the submission's own limits apart from the machine's."""

    def __init__(self, errno):
        self.errno = errno
        super().__init__(os.strerror(errno))


class Forker:
    """The grader's end of a zygote's control socket (dpcourse.grading.zygote's protocol): fork a
    rank, signal it, learn of its exit, clean up the processes ranks left."""

    def __init__(self, control):
        self.control, self.exits, self.dead = control, {}, False
        self.memory = {}  # pid -> what the zygote measured of a rank launched with a memory probe

    def run(self, spec, fds, payload):
        message = json.dumps(dict(spec, cmd="run", size=len(payload))).encode()
        socket.send_fds(self.control, [message], fds)
        for start in range(0, len(payload), 64 * 1024):
            self.control.send(payload[start:start + 64 * 1024])
        answer = self._read_until(lambda m: "started" in m)
        if not answer["started"]:
            raise ForkRefused(int(answer.get("fork_failed") or 0))
        return answer["started"]

    def _read_until(self, wanted, timeout=30.0):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.control.settimeout(max(0.01, end - time.monotonic()))
            try:
                packet = self.control.recv(PACKET)
            except TimeoutError:
                break
            except OSError:
                packet = b""
            finally:
                with contextlib.suppress(OSError):
                    self.control.settimeout(None)
            if not packet:
                self.dead = True
                break
            message = json.loads(packet)
            self._note(message)
            if wanted(message):
                return message
        raise GraderFailure("the grading sandbox stopped answering")

    def _note(self, message):
        if "exited" in message:
            self.exits[message["exited"]] = message["status"]
            if "memory" in message:
                self.memory[message["exited"]] = message["memory"]

    def pump(self):
        """Read the zygote's pending messages (exits) without blocking."""
        try:
            self.control.setblocking(False)
            while True:
                packet = self.control.recv(PACKET)
                if not packet:
                    self.dead = True
                    return
                self._note(json.loads(packet))
        except BlockingIOError:
            pass
        except OSError:
            self.dead = True
        finally:
            with contextlib.suppress(OSError):
                self.control.setblocking(True)

    def send(self, **message):
        try:
            self.control.send(json.dumps(message).encode())
        except OSError:
            pass

    @property
    def alive(self):
        return not self.dead


class Zygote(Forker):
    """One sandbox with a warm interpreter that forks the rank of each launch, or (as root) the
    zygote of each submission (`open_submission`)."""

    def __init__(self, sandboxed, shared=False, scratch=None):
        control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        super().__init__(control)
        command = [os.path.abspath(sys.executable), "-m", "dpcourse.grading.zygote", str(theirs.fileno())]
        if sandboxed:
            command.append("--sandboxed")
        if sandboxed:
            binds = [(scratch, True)] if scratch else []
            self.proc, self.cgroup = sandbox.start(command, pass_fds=[theirs.fileno()],
                                                   env=sandbox.environment(), binds=binds,
                                                   keep_capabilities=shared,
                                                   stdin=subprocess_devnull())
        else:
            import subprocess

            env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
            for key in ("DPCOURSE_COURSE_ROOT", "DPCOURSE_DB_URL", "NBGRADER_EXECUTION", "JPY_SESSION_NAME"):
                env.pop(key, None)
            self.proc = subprocess.Popen(command, pass_fds=[theirs.fileno()], env=env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
            self.cgroup = None
        theirs.close()
        self.ready = False

    def wait_ready(self, timeout=120.0):
        self.control.settimeout(timeout)
        try:
            packet = self.control.recv(PACKET)
        except TimeoutError:
            packet = b""
        finally:
            self.control.settimeout(None)
        if not packet:
            raise GraderFailure(f"the grading sandbox did not start (exit status {self.proc.poll()})")
        self.ready = True

    @property
    def alive(self):
        return not self.dead and self.proc.poll() is None

    def open_submission(self):
        """A fresh submission's zygote (see dpcourse.grading.zygote): its own pid namespace, in its
        own cgroup (processes and memory limited per submission, not per machine user)."""
        if not self.ready:
            self.wait_ready()
        control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            socket.send_fds(self.control, [json.dumps({"cmd": "open"}).encode()], [theirs.fileno()])
        finally:
            theirs.close()
        answer = self._read_until(lambda m: "opened" in m)
        pid = answer["opened"]
        if not pid:
            control.close()
            if answer.get("fork_failed"):
                raise ForkRefused(answer["fork_failed"])
            raise GraderFailure("the grading sandbox could not open a submission's namespace")
        return Submission(control, self, pid)

    def close(self):
        self.control.close()
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass
        self.proc.wait()
        if self.cgroup is not None:
            self.cgroup.remove()


class Submission(Forker):
    """One submission's zygote inside a Zygote's sandbox: ranks and direct calls of that submission
    only. Closing it ends its pid namespace: every process any of its ranks started dies."""

    def __init__(self, control, zygote, pid):
        super().__init__(control)
        self.zygote, self.pid = zygote, pid
        self.host_pid = _host_pid(zygote.cgroup, pid)
        self.cgroup = sandbox.Cgroup()
        if self.host_pid is None:
            self.close()
            raise GraderFailure("the grader could not find a submission's sandbox among its processes")
        self.cgroup.add(self.host_pid)

    @property
    def alive(self):
        return not self.dead and self.zygote.alive

    def close(self):
        """End the submission: its zygote, and with it its whole pid namespace; then its cgroup."""
        with contextlib.suppress(OSError):
            self.control.close()  # its zygote's loop ends, and the zygote with it
        self.dead = True
        self.cgroup.kill_all()  # whatever is still there (by the cgroup's list: never a stale pid)
        self.cgroup.remove()


def _host_pid(cgroup, pid):
    """The pid, in this process's namespace, of the process a sandbox knows as `pid`: found among
    the processes of the sandbox's cgroup by the pids /proc/<pid>/status lists (NSpid)."""
    for _ in range(200):
        for host in cgroup.pids() if cgroup is not None else ():
            try:
                with open(f"/proc/{host}/status") as f:
                    line = next(li for li in f if li.startswith("NSpid:"))
            except (OSError, StopIteration):
                continue
            levels = line.split()[1:]  # here, in the sandbox's namespace, in the submission's (1)
            if len(levels) == 3 and int(levels[1]) == pid and levels[2] == "1":
                return host
        time.sleep(0.005)
    return None


def subprocess_devnull():
    import subprocess

    return subprocess.DEVNULL


