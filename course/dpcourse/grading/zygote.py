"""A warm interpreter inside a grading sandbox that forks one graded rank per request.

Why: the grader runs the learner's code in sandboxes (autograder/dpgrader/judge/sandbox.py) that
see only the released course and the Python environment. Starting Python and importing torch
costs seconds, and a hidden check launches ranks dozens of times, so each sandbox holds one of
these processes, started once with torch imported, and forks a fresh rank from it per launch:
the learner's code never ran in it, and each rank starts clean.

Control protocol (a SOCK_SEQPACKET socket to the grader, JSON packets):
  grader -> {"cmd": "run", "rank", "world_size", "group_timeout", "size"} with 4 fds attached
            (router socket, out, msg and diag pipes), then the payload in packets of at most
            64 KiB: cloudpickle of (learner program, pickled function, args, kwargs);
  zygote -> {"started": pid}, later {"exited": pid, "status": wait status};
  grader -> {"cmd": "signal", "pid", "sig"} and {"cmd": "clean"} (kill every other process of
            this sandbox's pid namespace: daemons a rank left behind);
  grader -> {"cmd": "preload", "modules"}: import those of PRELOADABLE, once, before later forks;
  grader -> {"cmd": "open"} with 1 fd attached (a new control socket): fork a submission's
            zygote, the first process of a new pid namespace, which serves that socket with
            this same protocol; zygote -> {"opened": its pid}. When its socket closes it exits,
            and the kernel kills every process of its namespace with it (daemons included).

Per submission (as root): the grader opens one submission's zygote per notebook it judges, so
nothing a learner's ranks left (a daemon, a file in /tmp) can reach the next learner; every rank
runs as the user id the grader chose for it (`spec["uid"]`: fresh for each submission and rank).

Inside a rank: the learner program (the notebook's code cells: imports, definitions,
assignments; bare expressions and loops are skipped, they are experiments and demos) runs
first, then the default process group joins the grader's router (dpcourse.grading.routed),
then the function runs and its plain result goes back as a wire frame (no pickle on the way
out: the grader must not unpickle what learner code wrote).
"""

import ast
import contextlib
import faulthandler
import gc
import importlib
import json
import os
import selectors
import signal
import socket
import sys
import time
import traceback

PACKET = 64 * 1024
# What the grader may ask a zygote to import before forking ranks (a notebook with plots imports
# pyplot in its first cell, which every rank of every launch runs again: 0.6 s each, or once here;
# notebook 14's checkpoints import torch.distributed.checkpoint: 0.9 s each).
PRELOADABLE = {"matplotlib.pyplot", "torch.distributed.checkpoint"}
_namespace = None  # the learner program's globals, in a graded rank
_program_errors = []  # what the learner's cells raised while being defined


def learner_object(name):
    """What the learner's code defined under `name` (how the grader's references resolve here)."""
    if _namespace is None:
        raise RuntimeError("no learner program in this process")
    if name not in _namespace:
        why = f" (your code raised {_program_errors[0]})" if _program_errors else ""
        raise NameError(f"name '{name}' is not defined{why}")
    return _namespace[name]


class LearnerName:
    """Stands for a learner-defined name; pickles by name and resolves inside a graded rank."""

    def __init__(self, name):
        self.name = name

    def __reduce__(self):
        return learner_object, (self.name,)


def rebuild_parameter(data, requires_grad, grad):
    """A parameter with its .grad: how the grader sends modules to a rank (pickle drops .grad, and a
    bug that forgets to zero gradients shows only when stale ones arrive)."""
    import torch

    parameter = torch.nn.Parameter(data, requires_grad)
    parameter.grad = grad
    return parameter


def call_learner(name, args, kwargs):
    """A direct call of the learner's `name` (a one-rank launch while grading): the plain result,
    and what the call left in each tensor or module argument (the grader copies it back)."""
    result = learner_object(name)(*args, **kwargs)
    return {"result": result, "args": [state_of(a) for a in args],
            "kwargs": {k: state_of(v) for k, v in kwargs.items()}}


def state_of(value):
    """A tensor's values, a module's parameters, buffers and gradients, or lists of these."""
    import torch

    if isinstance(value, torch.nn.Module):
        return {"parameters": {n: p.detach().clone() for n, p in value.named_parameters()},
                "buffers": {n: b.detach().clone() for n, b in value.named_buffers()},
                "grads": {n: p.grad.detach().clone() for n, p in value.named_parameters()
                          if p.grad is not None},
                "attributes": {n: v for n, v in vars(value).items() if not n.startswith("_") and _plain(v)}}
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if type(value) in (list, tuple):
        return [state_of(v) for v in value]
    return None


def _plain(value):
    """Numbers, strings and lists of them: a module's plain attributes (a loss that counts calls)."""
    if type(value) in (int, float, bool, str):
        return True
    return type(value) in (list, tuple) and all(type(v) in (int, float, bool, str) for v in value)


KEPT_STATEMENTS = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                   ast.Assign, ast.AnnAssign, ast.AugAssign)


def definitions(source):
    """The statements of a cell that define something, compiled; None if it does not parse."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    tree.body = [node for node in tree.body if isinstance(node, KEPT_STATEMENTS)]
    return tree


def run_program(cells):
    """Execute the learner program's cells in one fresh namespace, each on its own (as Run All
    with errors allowed): a cell that raises does not stop the cells after it."""
    import builtins

    namespace = {"__name__": "__main__", "__builtins__": builtins}
    for index, source in enumerate(cells):
        tree = definitions(source)
        if tree is None:
            try:
                compile(source, f"<cell {index}>", "exec")
            except SyntaxError as exc:
                _program_errors.append(f"SyntaxError: {exc.msg} (line {exc.lineno})")
            continue
        try:
            exec(compile(tree, f"<cell {index}>", "exec"), namespace)  # noqa: S102 - the learner's code
        except BaseException as exc:  # noqa: BLE001 - recorded; later cells still run
            _program_errors.append(f"{type(exc).__name__}: {exc}")
    return namespace


CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWIPC, CLONE_NEWUTS = 0x20000, 0x40000000, 0x08000000, 0x04000000
CLONE_NEWPID = 0x20000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_MOVE = 2, 4, 8, 0x1000, 0x2000
MS_REC, MS_PRIVATE = 0x4000, 0x40000
PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 4, 38
FIRST_UID = 61000  # without a uid from the grader, rank r runs as user 61000 + r


def _libc_call(what):
    """A checker for libc calls (0 on success): raises OSError naming `what` otherwise."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def check(result, step):
        if result != 0:
            raise OSError(ctypes.get_errno(), f"{what}: {step}")
    return libc, check


def isolate(rank, scratch=None, shared=(), uid=None):
    """Cut this rank off from the other ranks of the sandbox, then give up root for good.

    Several ranks share one sandbox (one warm interpreter is much cheaper than one per rank), so
    each rank gets its own network (none), IPC, /tmp and /dev/shm, and its own unprivileged user
    (`uid`, which the grader chooses fresh for each submission): it cannot signal, trace or read the
    memory of another rank or of another learner's processes, nor raise any limit. The grader's
    scratch folder is hidden, but for the folders of it named in `shared` (a checkpoint folder a
    test hands every rank of a launch): any other writable place shared by ranks would be a way
    around the messages.
    """
    libc, check = _libc_call("could not isolate the rank")
    check(libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
    check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "private mounts")
    for path, size in ((b"/tmp", b"256m"), (b"/dev/shm", b"64m")):
        check(libc.mount(b"tmpfs", path, b"tmpfs", MS_NOSUID | MS_NODEV, b"size=" + size + b",mode=1777"),
              f"a private {path.decode()}")
    if scratch:
        kept = []
        for index, folder in enumerate(shared):  # set aside, to show again on top of the hiding tmpfs
            hold = f"/tmp/.shared{index}".encode()
            os.mkdir(hold)
            check(libc.mount(folder.encode(), hold, None, MS_BIND, None), "a shared folder")
            kept.append((hold, folder))
        check(libc.mount(b"tmpfs", scratch.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1m,mode=0755"),
              "hiding the grader's scratch folder")
        for hold, folder in kept:
            os.makedirs(folder, exist_ok=True)
            check(libc.mount(hold, folder.encode(), None, MS_MOVE, None), "a shared folder")
    uid = FIRST_UID + rank if uid is None else uid
    os.makedirs("/tmp/home", exist_ok=True)
    os.chown("/tmp/home", uid, uid)
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # from root to another user: every capability is dropped
    os.umask(0)  # ranks are different users: in a shared folder, rank 1 may overwrite rank 0's file
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no new privileges")
    check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "not dumpable")


def _rank_main(spec, fds, payload, zygote_pid):
    """The forked rank: define the learner program, join the router, run, report, exit."""
    global _namespace
    router_fd, out_w, msg_w, diag_w = fds
    code = 1
    try:
        from dpcourse.grading import routed, wire
        from dpcourse.runtime import inside_rank

        inside_rank.die_with_parent(zygote_pid)
        if spec.get("probe_fd") is not None:
            inside_rank.measured_by(spec["probe_fd"])
        if spec.get("isolate"):
            isolate(spec["rank"], spec.get("scratch"), spec.get("shared", ()), spec.get("uid"))
        inside_rank.redirect_output(out_w)
        import cloudpickle
        import torch

        torch.set_num_threads(1)
        faulthandler.register(signal.SIGUSR1, file=os.fdopen(diag_w, "w", closefd=False), all_threads=True)
        rank, world = spec["rank"], spec["world_size"]
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_WORLD_SIZE=str(world), DPCOURSE_GRADED_RANK="1")
        program, function = cloudpickle.loads(payload)
        _namespace = run_program(program)
        if spec.get("serve"):
            _serve_calls(socket.socket(fileno=router_fd))
            code = 0
            return
        fn, args, kwargs = cloudpickle.loads(function)
        routed.join(socket.socket(fileno=router_fd), rank, world, spec["group_timeout"])
        value = inside_rank.to_cpu(fn(*args, **kwargs))
        inside_rank.flush_output()
        try:
            frame = wire.encode_value({"status": "ok", "t": time.monotonic(), "value": value})
        except TypeError as exc:
            frame = _error_frame(wire, "TypeError", str(exc), "")
        _write(msg_w, frame)
        code = 0
    except BaseException as exc:  # noqa: BLE001 - every failure is reported
        from dpcourse.grading import wire

        trace = "".join(traceback.format_exception(exc))
        _write(msg_w, _error_frame(wire, type(exc).__name__, str(exc), trace))
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:  # noqa: BLE001
            pass
        os._exit(code)


def _serve_calls(sock):
    """Answer the grader's direct calls of learner functions, one at a time, until it hangs up.

    Why: a hidden check may call a plain learner function hundreds of times (every n, rank and
    world size of a sharding rule); a launch per call would cost a fork each. Requests come from
    the grader (cloudpickle: trusted direction), answers go back as wire frames.
    """
    import cloudpickle

    from dpcourse.grading import wire
    from dpcourse.runtime import inside_rank

    while True:
        head = wire.read_exact(sock, inside_rank.LENGTH_PREFIX.size)
        if head is None:
            return
        size = inside_rank.LENGTH_PREFIX.unpack(head)[0]
        name, args, kwargs = cloudpickle.loads(wire.read_exact(sock, size))
        try:
            report = {"status": "ok", "value": inside_rank.to_cpu(call_learner(name, args, kwargs))}
            frame = wire.encode_value(report)
        except BaseException as exc:  # noqa: BLE001 - the learner's error, sent back as the answer
            frame = wire.encode_value({"status": "error", "type": type(exc).__name__, "message": str(exc),
                                       "traceback": "".join(traceback.format_exception(exc))})
        inside_rank.flush_output()
        sock.sendall(frame)


def _error_frame(wire, kind, message, trace):
    return wire.encode_value({"status": "error", "t": time.monotonic(), "type": kind,
                              "message": message, "traceback": trace})


def _write(fd, frame):
    from dpcourse.runtime.inside_rank import LENGTH_PREFIX

    blob = LENGTH_PREFIX.pack(len(frame)) + frame
    view = memoryview(blob)
    while view:
        view = view[os.write(fd, view):]


def _leftovers(sandboxed):
    """Processes a rank left behind. In a sandbox (its own pid namespace) that is every process
    but init and this one; unsandboxed, only those of this zygote's session (never the host's)."""
    me, mine = os.getpid(), os.getsid(0)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in (1, me):
            continue
        try:
            if sandboxed or os.getsid(int(entry)) == mine:
                found.append(int(entry))
        except OSError:
            continue
    return found


def serve(control, sandboxed):
    """The zygote's loop: fork ranks on request, report their exits, clean up between launches.

    A rank's exit is reported as soon as it happens (SIGCHLD wakes the loop), not at the next
    tick: a graded launch waits for every rank's exit, and hidden checks launch dozens of times.
    """
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ)
    wake_r, wake_w = os.pipe()
    for fd in (wake_r, wake_w):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector.register(wake_r, selectors.EVENT_READ)
    children, probes = set(), {}  # probes: pid -> Probe of a rank whose memory is measured
    while True:
        for key, _ in selector.select(0.02):
            if key.fileobj == wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
                continue
            if isinstance(key.data, Probe):
                key.data.answer(selector)
                continue
            packet, fds, _, _ = socket.recv_fds(control, PACKET, 8)
            if not packet:
                return
            message = json.loads(packet)
            if message["cmd"] == "run":
                payload = bytearray()
                while len(payload) < message["size"]:
                    payload += control.recv(PACKET)
                probe = Probe() if message.get("probe") else None
                pid = os.fork()
                if pid == 0:
                    control.close()
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    os.close(wake_r)
                    os.close(wake_w)
                    for other in probes.values():
                        other.ours.close()
                    if probe is not None:
                        probe.ours.close()
                        message["probe_fd"] = probe.theirs.detach()
                    _rank_main(message, fds, bytes(payload), os.getppid())
                for fd in fds:
                    os.close(fd)
                children.add(pid)
                if probe is not None:
                    probe.started(pid, selector)
                    probes[pid] = probe
                control.send(json.dumps({"started": pid}).encode())
            elif message["cmd"] == "signal":
                if message["pid"] in children:
                    try:
                        os.kill(message["pid"], message["sig"])
                    except ProcessLookupError:
                        pass
            elif message["cmd"] == "preload":
                for module in set(message["modules"]) & PRELOADABLE:
                    with contextlib.suppress(Exception):
                        importlib.import_module(module)
                gc.freeze()  # as at the start (main)
            elif message["cmd"] == "open":
                opened = _open_submission(control, fds[0], (wake_r, wake_w))
                control.send(json.dumps({"opened": opened}).encode())
            elif message["cmd"] == "clean":
                for pid in _leftovers(sandboxed):
                    if pid not in children:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
        while True:  # reap every child: ranks, and (as a namespace's first process) orphans too
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not pid:
                break
            if pid in children:
                children.discard(pid)
                report = {"exited": pid, "status": status}
                if pid in probes:
                    report["memory"] = probes.pop(pid).finished(usage, selector)
                control.send(json.dumps(report).encode())


def memory_now(pid="self"):
    """(anonymous resident bytes, all resident bytes) of a process, from /proc/<pid>/status."""
    found = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "VmRSS"):
                found[key] = int(value.split()[0]) * 1024
    return found.get("RssAnon", 0), found.get("VmRSS", 0)


class Probe:
    """This zygote's end of a rank's memory probe (grader-only measurements of what a rank holds).

    The rank names moments (dpcourse.runtime.inside_rank.memory_mark: "built", "after step 0");
    at each, while the rank waits, the zygote reads the rank's resident memory from /proc and keeps
    the number: the rank never sees it, so no learner code can change it. When the rank exits, its
    exit report carries the marks, the zygote's own resident memory when it forked the rank (the
    rank's start: what it shares with the zygote) and the rank's peak resident memory (the
    kernel's count, from wait4).
    """

    MARKS = 200  # marks kept per rank
    LABEL = 60  # characters of a mark's label

    def __init__(self):
        self.ours, self.theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.start, self.marks, self.pid = memory_now(), [], None

    def started(self, pid, selector):
        self.pid = pid
        self.theirs.close()
        selector.register(self.ours, selectors.EVENT_READ, self)

    def answer(self, selector):
        try:
            label = self.ours.recv(256)
        except OSError:
            label = b""
        if not label:
            selector.unregister(self.ours)
            self.ours.close()
            return
        try:
            anon, rss = memory_now(self.pid)
        except OSError:
            anon = rss = -1
        if len(self.marks) < self.MARKS:
            self.marks.append([label.decode(errors="replace")[:self.LABEL], anon, rss])
        with contextlib.suppress(OSError):
            self.ours.send(b"1")

    def finished(self, usage, selector):
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(self.ours)
        self.ours.close()
        return {"start_anon": self.start[0], "start_rss": self.start[1], "marks": self.marks,
                "peak_rss": usage.ru_maxrss * 1024}


def _open_submission(control, fd, inherited):
    """Fork a submission's zygote: the first process of a new pid namespace (and mount namespace,
    with its own /proc), serving the control socket `fd`. Returns its pid here (0 if it failed).

    A process cannot move itself into a new pid namespace, only its later children: a middle
    process unshares, forks the submission's zygote and exits.
    """
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle == 0:
        try:
            control.close()
            os.close(read_end)
            libc, check = _libc_call("could not open a submission's sandbox")
            check(libc.unshare(CLONE_NEWPID | CLONE_NEWNS), "unshare")
            pid = os.fork()
            if pid == 0:
                os.close(write_end)
                _submission_main(fd, inherited)
            os.write(write_end, str(pid).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    os.close(fd)
    answer = os.read(read_end, 32)
    os.close(read_end)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(middle, 0)
    return int(answer or 0)


def _submission_main(fd, inherited):
    """A submission's zygote: pid 1 of its namespace, with its own /proc; serves until its socket closes."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for other in inherited:
            os.close(other)
        libc, check = _libc_call("could not set up a submission's sandbox")
        check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "private mounts")
        check(libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None), "its own /proc")
        serve(socket.socket(fileno=fd), sandboxed=True)
        code = 0
    finally:
        os._exit(code)


def main():
    control = socket.socket(fileno=int(sys.argv[1]))
    sandboxed = "--sandboxed" in sys.argv[2:]
    if sandboxed and os.getpid() > 8:  # bwrap --unshare-pid makes us one of the first pids
        raise SystemExit("--sandboxed given, but this process is not in its own pid namespace")
    # Warm up what every rank needs, once: torch, the router's process group, cloudpickle.
    import cloudpickle  # noqa: F401
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401 - optimizers import it; forked ranks inherit it

    from dpcourse.grading import routed  # noqa: F401

    os.environ.setdefault("MPLBACKEND", "Agg")  # ranks draw nothing
    # What was imported here lives as long as the zygote: out of the collector's sight, so that a rank's
    # garbage collections scan only its own objects (a full one took ~0.4 s with torch's) and do not
    # touch, and so copy, the pages it shares with the zygote.
    gc.collect()
    gc.freeze()

    control.send(json.dumps({"ready": os.getpid()}).encode())
    serve(control, sandboxed)


if __name__ == "__main__":  # run as the module proper, so references to learner_object resolve here
    from dpcourse.grading import zygote

    zygote.main()
