"""Run a launch's ranks in sandboxes, talking only through the router: `launch` while grading.

`RankPool` keeps one sandbox per rank index, each holding a warm interpreter (a zygote, see
dpcourse.grading.zygote) that forks the rank of every launch. Rank r of a launch runs in
sandbox r: ranks cannot reach each other (no network, no shared files), only the router in
this process. The launcher's own supervision (output relay, deadline, failure report naming
the rank to blame) runs unchanged on these ranks: only polling and signalling go through the
zygote, and the report a rank writes is decoded as a wire frame, never unpickled.

    pool = RankPool(program_cells, sandboxed=True)
    with pool.installed():           # every dpcourse.launch in this process now runs here
        results = launch(fn, 4, x)
    pool.last_traffic                # per rank: the router's CommOp log of that launch
"""

import collections
import contextlib
import io
import os
import pickle
import re
import select
import signal
import socket
import threading
import time

import cloudpickle
import torch

from dpcourse.grading import wire
from dpcourse.grading.zygote import rebuild_parameter
from dpcourse.runtime import launcher
from dpcourse.runtime.inside_rank import LENGTH_PREFIX, for_rank
from dpgrader.judge import sandbox, zygotes
from dpgrader.judge.router import Router
from dpgrader.judge.zygotes import ForkRefused, GraderFailure, Zygote  # noqa: F401 - GraderFailure: cells.py's

# module -> text of a program that imports it
PRELOAD_HINTS = {"matplotlib.pyplot": "matplotlib",
                 "torch.distributed.checkpoint": "torch.distributed.checkpoint"}
OUTPUT_LIMIT = 64 * 1024  # bytes of output relayed per rank and launch; the rest is dropped
REPORT_LIMIT = 256 << 20  # bytes of one rank's result (a state_dict, tensors)
TEXT_LIMIT = 20_000  # characters of a rank's error message or traceback kept (its own text)
SESSION_UID = 64  # the learner process of direct calls runs as uid_base + 64


def _reduce_parameter(parameter):
    return rebuild_parameter, (parameter.detach(), parameter.requires_grad, parameter.grad)


def _reduce_torch_ops(ops):
    return getattr, (torch, "ops")


class GradientKeepingPickler(cloudpickle.CloudPickler):
    """cloudpickle, keeping parameters' gradients (see dpcourse.grading.zygote.rebuild_parameter),
    and sending `torch.ops` by reference (a test function that reads `rec.ops` makes cloudpickle
    try to ship torch's operator namespace, which cannot be pickled)."""

    dispatch_table = collections.ChainMap({torch.nn.Parameter: _reduce_parameter,
                                           type(torch.ops): _reduce_torch_ops},
                                          cloudpickle.CloudPickler.dispatch_table)


def dumps(obj):
    buffer = io.BytesIO()
    GradientKeepingPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


class BudgetSpent(RuntimeError):
    """The submission's time budget for grading is used up: its remaining launches and calls fail."""


class RemoteRank:
    """The launcher's handle on a rank that a zygote forked: poll, signal, decode its report."""

    def __init__(self, zygote, pid):
        self.zygote, self.pid = zygote, pid

    def poll(self, block=False):
        end = time.monotonic() + (10.0 if block else 0.0)
        while True:
            self.zygote.pump()
            if self.pid in self.zygote.exits:
                return self.zygote.exits.pop(self.pid)
            if not self.zygote.alive:
                return signal.SIGKILL  # the sandbox is gone, and its ranks with it
            if time.monotonic() >= end:
                return None
            time.sleep(0.002)

    def signal(self, sig):
        self.zygote.send(cmd="signal", pid=self.pid, sig=int(sig))

    @staticmethod
    def decode(data):
        value = wire.decode_value_frame(data)
        if not isinstance(value, dict) or value.get("status") not in ("ok", "error"):
            return ("error", time.monotonic(), "ProtocolError", "the rank's report was malformed", "")
        if value["status"] == "ok":
            return ("ok", value.get("t", 0.0), value.get("value"))
        return ("error", value.get("t", 0.0), str(value.get("type"))[:200], _capped(value.get("message")),
                _capped(value.get("traceback")))


def _capped(text):
    """A rank's own text (an error message, a traceback), shown as it is up to TEXT_LIMIT characters."""
    text = str(text)
    return text if len(text) <= TEXT_LIMIT else text[:TEXT_LIMIT] + "\n... (cut)"


class CallSession:
    """A learner process that answers direct calls (dpcourse.grading.zygote._serve_calls)."""

    def __init__(self, pool):
        self.pool = pool
        self.sock, theirs = socket.socketpair()
        pipes = [os.pipe() for _ in range(3)]
        spec = {"rank": 0, "world_size": 1, "group_timeout": 10.0, "isolate": pool.shared, "serve": True,
                "scratch": str(pool.scratch) if pool.scratch else None, "uid": pool.uid(SESSION_UID)}
        payload = cloudpickle.dumps((pool.program, None))
        try:
            zygote = pool.zygote_of(0)
            self.pid = zygote.run(spec, [theirs.fileno(), *(w for _, w in pipes)], payload)
            self.control = RemoteRank(zygote, self.pid)
        finally:
            theirs.close()
            for _, w in pipes:
                os.close(w)
        self.out, self.reads = pipes[0][0], [r for r, _ in pipes[1:]]
        self.output, self.lock = bytearray(), threading.Lock()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        while True:
            try:
                chunk = os.read(self.out, 65536)
            except OSError:
                return
            if not chunk:
                return
            with self.lock:
                if len(self.output) < OUTPUT_LIMIT:
                    self.output += chunk[:OUTPUT_LIMIT - len(self.output)]

    def call(self, name, args, kwargs, timeout):
        """(report, printed text): the learner's answer to one call, within `timeout` seconds."""
        blob = dumps((name, args, kwargs))
        deadline = time.monotonic() + timeout
        self.sock.settimeout(timeout)
        try:
            self.sock.sendall(LENGTH_PREFIX.pack(len(blob)) + blob)
            report = self._answer(deadline)
        except TimeoutError:
            self.close()
            raise TimeoutError(f"{name} did not return within {timeout:g} s (an endless loop, or a wait "
                               f"for a message nobody sends?)") from None
        except (OSError, wire.WireError):
            report = None
        if report is None:
            self.close()
            raise RuntimeError(f"{name} ended the process it ran in (os._exit, a crash, too much memory, "
                               f"or a process it started that killed it)") from None
        time.sleep(0.005)  # let the last lines it printed arrive
        with self.lock:
            printed, self.output = self.output.decode(errors="replace"), bytearray()
        return report, printed

    def _answer(self, deadline):
        """The report of the call in flight, or None once the learner process has ended without one.

        Why not simply wait for the socket: a process the learner forked (a daemon) holds the socket
        open, so the end of the learner process is not an end of file; its exit, which the zygote
        reports, is looked for every POLL_EXIT seconds."""
        while not select.select([self.sock], [], [], self.POLL_EXIT)[0]:
            if self.control.poll() is not None:
                self.ended = True
                return None
            if time.monotonic() >= deadline:
                raise TimeoutError
        self.sock.settimeout(max(0.1, deadline - time.monotonic()))
        return wire.read_value(self.sock, REPORT_LIMIT)

    POLL_EXIT = 0.1  # seconds between looks at whether the learner process is still there
    ended = False  # the zygote reported the learner process's exit

    def close(self):
        """Kill the learner process, and every process it started (daemons of a direct call)."""
        self.control.signal(signal.SIGKILL)
        if not self.ended:
            self.control.poll(block=True)
        self.control.zygote.send(cmd="clean")
        for fd in (self.out, *self.reads):
            try:
                os.close(fd)
            except OSError:
                pass
        self.sock.close()
        self.pool.session = None


class RankPool:
    """Sandboxes for the ranks of every launch of one graded notebook."""

    def __init__(self, program=(), sandboxed=True, prestart=0, scratch=None):
        self.program, self.sandboxed, self.scratch = list(program), sandboxed, scratch
        # As root, every rank shares one sandbox and the zygote isolates each rank it forks;
        # otherwise (bwrap through user namespaces) each rank index gets a sandbox of its own.
        self.shared = sandboxed and sandbox.can_isolate_ranks()
        self.last_traffic, self.last_flow, self.launches, self.session = None, None, 0, None
        self.last_memory = None  # per rank, what its zygote measured (launches with measure_memory)
        self.deferred = []  # checks to run once the test cell's own checks passed (launcher.check_after_cell)
        self.submission, self.uid_base = None, None  # as root: this submission's zygote and user ids
        self.rank_memory, self.oom_kills = [], 0  # measured ranks' memory cgroups; OOM kills seen in them
        self.starved = []  # signs, seen outside the learner's code, that the machine ran short (see starve)
        count = 1 if self.shared else prestart
        self.zygotes = zygotes.take_early(sandboxed, scratch) or [
            Zygote(sandboxed, self.shared, scratch) for _ in range(count)]  # warming up

    def set_program(self, program):
        """Judge another submission with the same sandboxes: as root, in a submission's zygote of its
        own (a fresh pid namespace, cgroup and user ids), opened at its first launch or call."""
        self._close_submission()
        self.starved, self.oom_kills = [], 0
        self.program = list(program)
        self._preload()

    def _close_submission(self):
        if self.session is not None:
            self.session.close()
        if self.submission is not None:
            self.submission.close()
        self.submission, self.uid_base = None, None

    def end_submission(self):
        """The submission is judged: kill its whole pid namespace now (not at the next one), and say
        how often its processes reached their cgroup's limits."""
        reached = self.submission.cgroup.limits_reached() if self.submission is not None else {}
        if self.submission is not None:
            killed = self.submission.cgroup.oom_kills() + self.oom_kills
            if killed and not reached.get("memory"):
                self.starved.append(f"the kernel's OOM killer killed {killed} of its processes while it was "
                                    f"within its own memory limit: the machine ran out of memory")
        self._close_submission()
        self.budget_end = None
        return reached

    def fork_refused(self, rank, refused):
        """What a launch raises when the kernel refused to fork rank `rank` (seen by its zygote, never
        read from the learner's text). The submission's own fault where its processes reached their own
        cgroup's limits, or where there is no cgroup to tell (grading without root); otherwise the
        machine ran short, which `starved` records: autograde.py judges the submission again."""
        what = f"rank {rank} could not be started (the kernel refused to fork it: {refused})"
        reached = self.submission.cgroup.limits_reached() if self.submission is not None else None
        if reached is None or not self.submission.cgroup.enforced:
            return RuntimeError(f"{what}: too many processes or too much memory in use")
        if reached.get("processes") or reached.get("memory"):
            return RuntimeError(f"{what}: this notebook's processes reached their limits "
                                f"({sandbox.LIMITS['pids']} processes and threads, "
                                f"{sandbox.LIMITS['memory_bytes'] >> 20} MiB)")
        self.starved.append(f"{what} while the notebook was within its own limits")
        return RuntimeError(f"{what}: the machine ran short, not this notebook (it is judged again)")

    def set_budget(self, seconds, why=""):
        """Launches and calls from now on end within `seconds` in all (None: no budget); past it they
        raise BudgetSpent saying `why` the budget is what it is."""
        self.budget_end = None if seconds is None else time.monotonic() + float(seconds)
        self.budget_spent = False  # set when a launch or call was refused for it (cells.py reports it)
        self.budget, self.budget_why = seconds, why

    def _within_budget(self, seconds):
        """`seconds`, shortened to what is left of the budget; BudgetSpent once it is gone."""
        if getattr(self, "budget_end", None) is None:
            return seconds
        left = self.budget_end - time.monotonic()
        if left <= 0.5:
            self.budget_spent = True
            raise BudgetSpent(f"not run: this notebook used up its time budget for grading ({self.budget:g} s"
                              f"{self.budget_why}) before this point")
        return min(seconds, left)

    def uid(self, offset):
        """The user id of this submission's rank `offset` (None: the zygote's default)."""
        return None if self.uid_base is None else self.uid_base + offset

    def source_line(self, path, line):
        """The text of line `line` of the learner's cell `path` ("<cell N>") for a failure report;
        None for any other path. No file is ever opened: paths come from the ranks' own dumps."""
        match = re.fullmatch(r"<cell (\d+)>", path)
        if not match or int(match[1]) >= len(self.program):
            return None
        lines = self.program[int(match[1])].splitlines()
        index = int(line) - 1
        return lines[index] if 0 <= index < len(lines) else None

    def _preload(self):
        """Ask the zygotes to import, once, what this program imports in every rank of every launch
        (pyplot: 0.6 s a rank); only modules the zygote knows (zygote.PRELOADABLE) are imported."""
        wanted = [module for module, hint in PRELOAD_HINTS.items() if any(hint in c for c in self.program)]
        for zygote in self.zygotes if wanted else ():
            zygote.send(cmd="preload", modules=wanted)

    def call(self, name, args, kwargs, timeout=60.0):
        """A direct call of the learner's `name`: ("ok", value) or ("error", type, message)."""
        if getattr(self, "refusal", None):
            raise RuntimeError(f"{self.refusal} may not run the learner's code while grading")
        timeout = self._within_budget(timeout)
        self.ensure(1)
        if self.session is None:
            try:
                self.session = CallSession(self)
            except ForkRefused as refused:
                raise self.fork_refused(0, refused) from None
        report, printed = self.session.call(name, args, kwargs, timeout)
        if printed:
            print(printed, end="" if printed.endswith("\n") else "\n")
        return report

    def zygote_of(self, rank):
        """Who forks rank `rank`: this submission's zygote (as root), else that rank's sandbox."""
        if not self.shared:
            return self.zygotes[rank]
        if self.submission is None or not self.submission.alive:
            if self.submission is not None:
                self._close_submission()
            try:
                self.submission = self.zygotes[0].open_submission()
            except ForkRefused as refused:  # no process of this notebook's exists yet: the machine's
                self.starved.append(f"its sandbox could not be started (the kernel refused to fork: "
                                    f"{refused})")
                raise RuntimeError(f"the grader could not start this notebook's sandbox (the kernel refused "
                                   f"to fork: {refused}): it is judged again") from None
            self.uid_base = sandbox.new_uid_block()
        return self.submission

    def ensure(self, world_size):
        wanted = 1 if self.shared else world_size
        started = len(self.zygotes)
        self.zygotes += [Zygote(self.sandboxed, self.shared, self.scratch) for _ in range(started, wanted)]
        if len(self.zygotes) > started:
            self._preload()
        for zygote in self.zygotes[:wanted]:
            if not zygote.ready:
                zygote.wait_ready()

    @contextlib.contextmanager
    def refusing(self, why):
        """Launches in this block raise at once (`why` says who may not launch)."""
        self.refusal = why
        try:
            yield
        finally:
            self.refusal = None

    @contextlib.contextmanager
    def installed(self):
        launcher.use_runner(self)
        try:
            yield self
        finally:
            launcher.use_runner(None)

    def close(self):
        self._close_submission()
        for zygote in self.zygotes:
            zygote.close()
        self.zygotes = []

    def launch(self, fn, world_size, args, kwargs, *, deadline, group_timeout):
        """What `dpcourse.launch` does while grading: same results, same errors."""
        if getattr(self, "refusal", None):
            raise RuntimeError(f"{self.refusal} may not launch ranks while grading")
        options = launcher.current_options()
        deadline = self._within_budget(deadline)
        self.ensure(world_size)
        shared = self._shared_folders(args, kwargs, options)
        forkers = [self.zygote_of(rank) for rank in range(world_size)]
        router_ends, ranks, router, self.rank_memory = [], [], None, []
        try:
            for rank in range(world_size):
                # each rank is sent its own inputs only (per_rank), never its peers'
                mine = for_rank((fn, args, kwargs), rank, world_size)
                payload = cloudpickle.dumps((self.program, dumps(mine)))
                try:
                    ranks.append(self._start(rank, world_size, group_timeout, payload, router_ends, shared,
                                             bool(options.get("measure_memory"))))
                except ForkRefused as refused:
                    raise self.fork_refused(rank, refused) from None
            router = Router(router_ends, **options)
            return launcher.supervise(ranks, deadline, group_timeout, source=self.source_line)
        finally:
            launcher.kill_and_reap(ranks)
            for forker in {id(f): f for f in forkers}.values():
                forker.send(cmd="clean")
            for sock in router_ends:
                sock.close()
            if router is not None:
                router.join(2.0)
                self.last_traffic = [router.ops_of(r) for r in range(world_size)]
                self.last_flow = router.flow
            self.last_memory = [f.memory.pop(r.pid, None) for f, r in zip(forkers, ranks, strict=False)]
            for memory in self.rank_memory:  # the ranks' own memory cgroups (measured launches, as root)
                self.oom_kills += memory.oom_kills()
                memory.remove()
            self.launches += 1

    def _start(self, rank, world_size, group_timeout, payload, router_ends, shared, probe=False):
        ours, theirs = socket.socketpair()
        router_ends.append(ours)
        pipes = [os.pipe() for _ in range(3)]
        cgroup_fds = self._rank_memory(rank) if probe else []
        try:
            spec = {"rank": rank, "world_size": world_size, "group_timeout": group_timeout,
                    "isolate": self.shared, "scratch": str(self.scratch) if self.scratch else None,
                    "shared": shared, "uid": self.uid(rank), "probe": probe}
            pid = self.zygote_of(rank).run(spec, [theirs.fileno(), *(w for _, w in pipes), *cgroup_fds],
                                           payload)
        except BaseException:
            for read_end, _ in pipes:
                os.close(read_end)
            raise
        finally:
            theirs.close()
            for fd in [*(w for _, w in pipes), *cgroup_fds]:
                os.close(fd)
        return launcher.Rank(rank, pid, pipes[0][0], pipes[1][0], pipes[2][0],
                             control=RemoteRank(self.zygote_of(rank), pid), output_limit=OUTPUT_LIMIT,
                             report_limit=REPORT_LIMIT)

    def _rank_memory(self, rank):
        """As root: the fds of a memory cgroup of rank `rank`'s own, inside its submission's, that the
        rank enters when forked; what its zygote measures is what is charged there (see
        dpcourse.grading.zygote.Probe). [] elsewhere: the zygote then reads /proc and the rank's tmpfs."""
        if not self.shared or self.submission is None:
            return []
        memory = self.submission.cgroup.memory_child(f"rank{rank}-{self.launches}")
        if memory is None:
            return []
        self.rank_memory.append(memory)
        try:
            return list(memory.fds())
        except OSError:
            return []

    def _shared_folders(self, args, kwargs, options):
        """The folders of the scratch folder this launch hands its ranks (a test's checkpoint folder):
        the only writable place its ranks share, and none in a point-to-point exercise."""
        if not self.scratch or options["p2p_only"]:
            return []
        root = os.path.realpath(self.scratch)
        found = set()

        def walk(value, depth):
            if isinstance(value, (str, os.PathLike)) and not isinstance(value, bytes):
                path = os.path.realpath(os.fspath(value))
                if path.startswith(root + os.sep) and os.path.isdir(path):
                    found.add(path)
            elif depth < 3 and isinstance(value, (list, tuple)):
                for item in value:
                    walk(item, depth + 1)
            elif depth < 3 and isinstance(value, dict):
                for item in value.values():
                    walk(item, depth + 1)

        walk([list(args), dict(kwargs)], 0)
        return sorted(found)
