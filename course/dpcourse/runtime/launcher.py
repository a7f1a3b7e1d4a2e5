"""Run a function on N ranks from a notebook, a script or a test, and get back what each returned.

    from dpcourse import launch
    results = launch(fn, 4, tensor)       # fn(tensor) runs on ranks 0..3; results[r] is rank r's value

Inside `fn` the default process group is already initialised: ask
`dist.get_rank()` and `dist.get_world_size()`.

Why not mp.spawn or torchrun? mp.spawn cannot pickle a function defined in a
notebook cell, torchrun's launcher restarts failed workers and blames the wrong
rank, and neither bounds a hang. This launcher:
  * forks on CPU (a launch costs ~0.1 s) and starts fresh interpreters with the
    function shipped by value when CUDA is involved (fork breaks CUDA);
  * gives each launch its own FileStore, so concurrent launches never collide;
  * bounds every launch twice: the process group's timeout turns a deadlock into
    an error, and a wall-clock deadline stops a rank spinning in Python;
  * on failure kills and reaps every rank and names the rank that failed first,
    with its traceback, or, for a hang, where each rank was stuck;
  * relays ranks' output as whole lines prefixed `[rank r]`, on stdout only
    (nbgrader scores a test cell 0 if it writes to stderr).
"""

import contextlib
import json
import os
import pickle
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from dpcourse.backend import resolve_backend
from dpcourse.runtime import inside_rank
from dpcourse.runtime.failures import describe_failure
from dpcourse.runtime.inside_rank import PerRank as per_rank  # noqa: F401 - launch's per-rank arguments
from dpcourse.runtime.timeouts import TIMEOUTS

DEFAULT_GROUP_TIMEOUT = TIMEOUTS["group"]  # seconds a recv or collective may wait for its peers


DEFAULT_DEADLINE = TIMEOUTS["launch"]  # seconds a whole launch may take


MAX_WORLD_SIZE = 64
DIAG_LIMIT = 64 * 1024  # bytes of a stuck rank's stack dump kept, where the caller limits reports
# A rank whose result is a dict with STOP_LAUNCH set has reported a failure its peers cannot get past
# (dpcourse.comm.cases: the learner's code raised). The launch then waits for the other ranks that can
# still report: every STOP_GRACE seconds it asks the ranks that have not reported for their stacks, and
# stops waiting for a rank once its stack shows it blocked in communication (it waits for the rank that
# failed); a rank still starting or running its own code (on a loaded machine four ranks of one launch
# can be seconds apart) is given up to STOP_WAIT seconds in all. Then the rest are stopped (their results
# are None), and the caller blames the lowest rank that failed and names the others that did the same.
STOP_LAUNCH = "dpcourse/stop-launch"
STOP_GRACE, STOP_WAIT, DUMP_WAIT = 0.3, 5.0, 2.0


def launch(fn, world_size, *args, backend=None, deadline=None, group_timeout=None, **kwargs):
    """Run `fn(*args, **kwargs)` on `world_size` ranks; return the list of their return values.

    backend: "gloo", "nccl" or None for $DPCOURSE_BACKEND, else automatic (NCCL with
    one GPU per rank when there are enough GPUs, gloo otherwise).
    deadline: wall-clock seconds for the whole launch ($DPCOURSE_DEADLINE, default 60).
    group_timeout: seconds a blocked recv/collective waits ($DPCOURSE_GROUP_TIMEOUT, default 10).
    Raises LaunchError naming the culprit rank if any rank fails, exits or hangs.
    """
    _check_caller(world_size)
    inside_rank.for_rank((args, kwargs), 0, world_size)  # per_rank arguments: one value per rank
    deadline = _seconds("DPCOURSE_DEADLINE", deadline, DEFAULT_DEADLINE)
    group_timeout = _seconds("DPCOURSE_GROUP_TIMEOUT", group_timeout, DEFAULT_GROUP_TIMEOUT)
    if _runner is not None:
        return _runner.launch(fn, world_size, args, kwargs, deadline=deadline, group_timeout=group_timeout)
    backend = resolve_backend(world_size, backend)
    workdir = tempfile.mkdtemp(prefix="dpcourse-")
    ranks = []
    try:
        spec = dict(world_size=world_size, backend=backend, group_timeout=group_timeout,
                    store_path=os.path.join(workdir, "store"), parent_pid=os.getpid())
        ranks = _start_ranks(fn, args, kwargs, spec, workdir)
        return supervise(ranks, deadline, group_timeout)
    finally:
        kill_and_reap(ranks)
        shutil.rmtree(workdir, ignore_errors=True)


_runner = None  # the grader's own way to run ranks (sandboxed, routed), installed in its process
_options = threading.local()


def use_runner(runner):
    """Make every `launch` in this process call `runner.launch(fn, world_size, args, kwargs,
    deadline=, group_timeout=)` instead of forking ranks here: how the grader runs test cells
    against the learner's code in sandboxes (autograder/dpgrader/judge). None restores forking.
    The runner's `last_traffic` (per rank, the calls it saw) is what `observed_traffic` returns."""
    global _runner
    _runner = runner


def current_runner():
    """The runner `use_runner` installed (the grader's), or None when launches fork here."""
    return _runner


def observed_traffic():
    """Per rank, the communication calls of the last launch as the grader's router saw them
    (CommOp lists); None when ranks run here (then each rank records its own)."""
    return None if _runner is None else _runner.last_traffic


def observed_messages():
    """While graded, what the last launch's messages carried, in the router's order (see the
    grader's router: ("post", src, dst, id) and ("deliver", src, dst, id, tensor)); None otherwise."""
    return None if _runner is None else getattr(_runner, "last_flow", None)


def check_after_cell(check):
    """While graded, run `check()` once the test cell that is running has passed every check of its
    own: a check of how a result was reached (dpcourse.comm.provenance) speaks only about results
    that are right, so a wrong result keeps its own message. Not graded: nothing to do."""
    if _runner is not None and hasattr(_runner, "deferred"):
        _runner.deferred.append(check)


def observed_memory():
    """While graded with launch_options(measure_memory=True), per rank what its zygote measured of the
    last launch: {"how", "start_held", "marks": [[label, held, anonymous, shared, tmpfs bytes]],
    "peak_rss"} (dpcourse.grading.zygote.Probe), or None for a rank that was not measured; None when
    not graded."""
    return None if _runner is None else getattr(_runner, "last_memory", None)


@contextlib.contextmanager
def launch_options(p2p_only=False, exercise="this exercise", keep_messages=None, measure_memory=False):
    """Launches in this block are for an exercise built from send/recv only: the grader's router
    refuses their collectives (in a notebook the ranks' own recorder does it). keep_messages: the
    router keeps what each message carried (default: in point-to-point exercises). measure_memory:
    while graded, each rank's memory is measured from outside at its memory_mark calls."""
    previous = getattr(_options, "value", None)
    _options.value = {"p2p_only": p2p_only, "exercise": exercise, "keep_messages": keep_messages,
                      "measure_memory": measure_memory}
    try:
        yield
    finally:
        _options.value = previous


def current_options():
    return getattr(_options, "value", None) or {"p2p_only": False, "exercise": "this exercise",
                                                "keep_messages": None, "measure_memory": False}


def _check_caller(world_size):
    import torch.distributed as dist

    if os.environ.get("DPCOURSE_GRADED_RANK"):
        raise RuntimeError("launch cannot start ranks from inside a rank that is being graded")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if world_size > MAX_WORLD_SIZE:
        raise ValueError(f"world_size={world_size} is more ranks than this launcher runs on one "
                         f"machine (at most {MAX_WORLD_SIZE})")
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "a default process group is already initialised in this process, so the ranks "
            "launched from it could not create their own. Call "
            "torch.distributed.destroy_process_group() first (or restart the kernel).")


def _seconds(env_name, value, default):
    value = value if value is not None else os.environ.get(env_name, default)
    value = float(value)
    if not value > 0:
        raise ValueError(f"{env_name.split('_', 1)[1].lower()} must be a positive number of seconds")
    return value


def _start_method():
    """fork on CPU (fast); a fresh interpreter once CUDA is involved (fork breaks CUDA)."""
    forced = os.environ.get("DPCOURSE_START_METHOD")
    if forced:
        if forced not in ("fork", "spawn"):
            raise ValueError(f"DPCOURSE_START_METHOD must be 'fork' or 'spawn', got {forced!r}")
        return forced
    import torch

    if sys.platform != "linux" or torch.cuda.is_initialized():
        return "spawn"
    return "fork"


@dataclass
class Rank:
    """The launcher's view of one rank: its process, its pipes and what it said."""

    rank: int
    pid: int
    out_fd: int
    msg_fd: int
    diag_fd: int
    popen: object = None
    partial_line: bytes = b""
    output_tail: list = field(default_factory=list)
    msg: bytes = b""
    diag: bytes = b""
    exit_status: int = None  # os.waitpid status once reaped
    exit_time: float = None
    report: tuple = None  # ("ok", t, value) or ("error", t, type, message, traceback)
    control: object = None  # how to poll and signal the process (LocalProcess unless the grader's)
    output_limit: int = None  # bytes of output relayed; the rest is dropped (the grader sets one)
    output_bytes: int = 0
    report_limit: int = None  # bytes of result a rank may send (the grader sets one; DIAG_LIMIT then too)

    def __post_init__(self):
        if self.control is None:
            self.control = LocalProcess(self.pid)

    @property
    def alive(self):
        return self.exit_status is None


class LocalProcess:
    """A rank that is this process's child: polled with waitpid, stopped with kill.

    The grader starts its ranks elsewhere (in sandboxes) and hands the launcher an object with
    the same three methods, so supervision, output relay and failure reports stay one code path.
    """

    decode = staticmethod(pickle.loads)  # the rank's report: trusted here, the rank is our child

    def __init__(self, pid):
        self.pid = pid

    def poll(self, block=False):
        """The wait status once the process has exited, else None."""
        pid, status = os.waitpid(self.pid, 0 if block else os.WNOHANG)
        return status if pid else None

    def signal(self, sig):
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass


def _start_ranks(fn, args, kwargs, spec, workdir):
    method = "spawn" if spec["backend"] == "nccl" else _start_method()
    pipes = [[os.pipe() for _ in range(3)] for _ in range(spec["world_size"])]
    payload = _write_payload(fn, args, kwargs, workdir) if method == "spawn" else None
    if method == "fork":
        _preload_for_fork()
    ranks = []
    try:
        for rank in range(spec["world_size"]):
            rank_spec = dict(spec, rank=rank)
            if method == "fork":
                pid, popen = _fork_rank(rank_spec, fn, args, kwargs, pipes, rank), None
            else:
                popen = _spawn_rank(rank_spec, payload, pipes[rank])
                pid = popen.pid
            ranks.append(Rank(rank, pid, pipes[rank][0][0], pipes[rank][1][0], pipes[rank][2][0],
                              popen=popen))
    finally:
        for rank_pipes in pipes:
            for _, write_end in rank_pipes:
                os.close(write_end)
        for rank_pipes in pipes[len(ranks):]:
            for read_end, _ in rank_pipes:
                os.close(read_end)
    return ranks


def _preload_for_fork():
    """Import once in the caller what every rank would otherwise import after the fork.

    The first optimizer a process creates imports torch._dynamo (~1.5 s here); forked
    ranks inherit it from the caller instead of paying it per rank and per launch.
    """
    import torch._dynamo  # noqa: F401


def _fork_rank(spec, fn, args, kwargs, pipes, rank):
    sys.stdout.flush()
    pid = os.fork()
    if pid:
        return pid
    try:  # the child: keep only this rank's write ends, then run
        (_, out_w), (_, msg_w), (_, diag_w) = pipes[rank]
        for other in pipes:
            for read_end, write_end in other:
                os.close(read_end)
                if write_end not in (out_w, msg_w, diag_w):
                    os.close(write_end)
        inside_rank.die_with_parent(spec["parent_pid"])
        inside_rank.redirect_output(out_w)
        inside_rank.run_rank(spec, fn, args, kwargs, msg_w, diag_w)
    finally:
        os._exit(1)  # never return into the caller's code (pytest, the kernel)


def _write_payload(fn, args, kwargs, workdir):
    import cloudpickle

    path = os.path.join(workdir, "payload.pkl")
    with open(path, "wb") as f:
        f.write(cloudpickle.dumps((fn, args, kwargs)))
    return path


def _spawn_rank(spec, payload, rank_pipes):
    (_, out_w), (_, msg_w), (_, diag_w) = rank_pipes
    env = dict(os.environ)
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    spec = dict(spec, sys_path=[os.path.abspath(p) for p in sys.path if p])
    cmd = [sys.executable, "-m", "dpcourse.runtime.inside_rank", payload, json.dumps(spec), str(msg_w),
           str(diag_w)]
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out_w, stderr=out_w,
                            pass_fds=(msg_w, diag_w), env=env)


def supervise(ranks, deadline, group_timeout, source=None):
    """Relay output and collect results until every rank reported, one failed, or time ran out.

    source: how a failure report finds the text of a line a rank's stack names (see
    dpcourse.runtime.failures); the grader's never opens a file."""
    selector = selectors.DefaultSelector()
    for r in ranks:
        for fd, kind in ((r.out_fd, "out"), (r.msg_fd, "msg"), (r.diag_fd, "diag")):
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ, (r, kind))
    try:
        end = time.monotonic() + deadline
        while True:
            # once every pipe closed, only the exits are awaited: look often (a launch costs ms)
            _pump(selector, timeout=0.02 if selector.get_map() else 0.002)
            _reap(ranks)
            if any(_stops(r) for r in ranks) and not any(_failed(r) for r in ranks):
                _await_reports(ranks, selector)
                kill_and_reap(ranks)
                return [r.report[2] if r.report is not None and r.report[0] == "ok" else None for r in ranks]
            if any(_failed(r) for r in ranks):
                _pump_for(selector, 0.3)  # let simultaneous failures (timeouts) report too
                # a rank reaped before its last message was read looked failed; judge it on the message
                if any(_failed(r) for r in ranks):
                    raise _failure(ranks, selector, deadline, group_timeout, source)
            if all(not r.alive for r in ranks):
                _pump_until_closed(selector)
                if any(_failed(r) for r in ranks):
                    raise _failure(ranks, selector, deadline, group_timeout, source)
                return [r.report[2] for r in ranks]
            if time.monotonic() > end:
                raise _failure(ranks, selector, deadline, group_timeout, source)
    finally:
        _flush_partial_lines(ranks)
        selector.close()
        for r in ranks:
            for fd in (r.out_fd, r.msg_fd, r.diag_fd):
                os.close(fd)


def _stops(r):
    """The rank reported a failure that ends the launch (see STOP_LAUNCH)."""
    return (r.report is not None and r.report[0] == "ok" and isinstance(r.report[2], dict)
            and r.report[2].get(STOP_LAUNCH) is True)


def _failed(r):
    if r.report is not None:
        return r.report[0] == "error"
    return not r.alive and not _msg_complete(r)  # exited without a word: os._exit, crash, kill


def _pump(selector, timeout):
    for key, _ in selector.select(timeout):
        r, kind = key.data
        try:
            chunk = os.read(key.fd, 1 << 20)
        except BlockingIOError:
            continue
        if not chunk:
            selector.unregister(key.fd)
            continue
        if kind == "out":
            _relay(r, chunk)
        elif kind == "msg":
            if r.report is not None:
                continue  # one report per rank: anything after it is ignored
            r.msg += chunk
            if r.report_limit is not None and len(r.msg) > 8 + r.report_limit:
                r.msg = b""
                r.report = ("error", time.monotonic(), "ValueError",
                            f"the function's result is larger than the {r.report_limit >> 20} MiB a graded "
                            f"rank may return", "")
            elif _msg_complete(r):
                r.report = r.control.decode(r.msg[8:])
        elif r.report_limit is None or len(r.diag) < DIAG_LIMIT:
            r.diag += chunk[:None if r.report_limit is None else DIAG_LIMIT - len(r.diag)]


def _pump_for(selector, seconds, until=None):
    end = time.monotonic() + seconds
    while time.monotonic() < end and not (until is not None and until()):
        _pump(selector, timeout=0.02)


def _await_reports(ranks, selector):
    """After a rank stopped the launch: read the reports of the ranks that can still send one (see
    STOP_LAUNCH), for at most STOP_WAIT seconds."""
    from dpcourse.runtime.failures import blocked_in_communication

    end = time.monotonic() + STOP_WAIT
    waiting = [r for r in ranks if r.alive and r.report is None]
    while waiting and time.monotonic() < end:
        _pump_for(selector, min(STOP_GRACE, end - time.monotonic()),
                  until=lambda group=waiting: all(r.report is not None or not r.alive for r in group))
        waiting = [r for r in waiting if r.alive and r.report is None]
        for r in waiting:
            r.diag = b""
        _await_stacks(waiting, selector, min(DUMP_WAIT, max(0.0, end - time.monotonic())))
        waiting = [r for r in waiting if r.alive and r.report is None
                   and not (not _diag_incomplete(r) and blocked_in_communication(r))]


def _await_stacks(alive, selector, seconds):
    """Ask `alive` ranks for their stacks (SIGUSR1: faulthandler) and read until each has dumped one, or for
    `seconds`; whatever else they send meanwhile (a report) is read too."""
    for r in alive:
        _signal(r, signal.SIGUSR1)
    end = time.monotonic() + seconds
    while time.monotonic() < end and any(_diag_incomplete(r) for r in alive if r.report is None):
        _pump(selector, timeout=0.02)


def _pump_until_closed(selector, limit=5.0):
    end = time.monotonic() + limit
    while selector.get_map() and time.monotonic() < end:
        _pump(selector, timeout=0.02)


def _msg_complete(r):
    size = inside_rank.LENGTH_PREFIX.size
    return len(r.msg) >= size and len(r.msg) >= size + inside_rank.LENGTH_PREFIX.unpack(r.msg[:size])[0]


def _relay(r, chunk):
    """Print whole lines only, each prefixed with its rank, so ranks never interleave mid-line."""
    if r.output_limit is not None:
        room = r.output_limit - r.output_bytes
        r.output_bytes += len(chunk)
        if room <= 0:
            return
        if len(chunk) > room:
            chunk = chunk[:room] + b"\n... (output cut: more than %d bytes)\n" % r.output_limit
    lines = (r.partial_line + chunk).split(b"\n")
    r.partial_line = lines.pop()
    for line in lines:
        _print_line(r, line)


def _print_line(r, line):
    text = line.decode(errors="replace")
    r.output_tail = (r.output_tail + [text])[-20:]
    print(f"[rank {r.rank}] {text}", flush=True)


def _flush_partial_lines(ranks):
    for r in ranks:
        if r.partial_line:
            _print_line(r, r.partial_line)
            r.partial_line = b""


def _reap(ranks):
    for r in ranks:
        if r.alive:
            status = r.control.poll()
            if status is not None:
                _exited(r, status)


def _exited(r, status):
    r.exit_status, r.exit_time = status, time.monotonic()
    if r.popen is not None:
        r.popen.returncode = os.waitstatus_to_exitcode(status)


def _failure(ranks, selector, deadline, group_timeout, source=None):
    """Collect the stacks of the ranks still running, kill everything, explain.

    A rank that died on its own (killed, crashed) while a peer's report of the lost connection came first
    is reaped before and after the stacks are asked for: it exited, it is not one the launcher stopped."""
    _reap(ranks)
    alive = [r for r in ranks if r.alive and r.report is None]
    _await_stacks(alive, selector, DUMP_WAIT)
    _reap(ranks)
    alive = [r for r in alive if r.alive and r.report is None]
    kill_and_reap(ranks)
    _pump_until_closed(selector, limit=0.5)
    _flush_partial_lines(ranks)
    return describe_failure(ranks, alive, deadline, group_timeout, source)


BOTTOM_FRAME = re.compile(rb'(inside_rank|zygote)\.py", line \d+ in \w+\n')


def _diag_incomplete(r):
    """faulthandler's dump is complete once it reaches the rank's bottom frame, in inside_rank.py."""
    return not BOTTOM_FRAME.search(r.diag)


def _signal(r, sig):
    r.control.signal(sig)


def kill_and_reap(ranks):
    """SIGKILL every rank still alive and wait for it: no zombie, no orphan."""
    for r in ranks:
        if r.alive:
            _signal(r, signal.SIGKILL)
    for r in ranks:
        if r.alive:
            _exited(r, r.control.poll(block=True))
