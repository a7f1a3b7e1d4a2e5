"""A warm interpreter inside a grading sandbox that forks one graded rank per request.

Why: the grader runs the learner's code in sandboxes (autograder/dpgrader/judge/sandbox.py) that
see only the released course and the Python environment. Starting Python and importing torch
costs seconds, and a hidden check launches ranks dozens of times, so each sandbox holds one of
these processes, started once with torch imported, and forks a fresh rank from it per launch:
the learner's code never ran in it, and each rank starts clean.

Control protocol (a SOCK_SEQPACKET socket to the grader, JSON packets):
  grader -> {"cmd": "run", "rank", "world_size", "group_timeout", "size"} with 4 fds attached
            (router socket, out, msg and diag pipes; as root, 3 more for a measured rank: its memory
            cgroup's, see Probe), then the payload in packets of at most 64 KiB: cloudpickle of
            (learner program, pickled function, args, kwargs); with "isolate" (as root) the rank is
            pid 1 of a pid namespace of its own, with its own /proc;
  zygote -> {"started": pid} (or {"started": 0, "fork_failed": errno}: the kernel refused the fork),
            later {"exited": pid, "status": wait status};
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
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_MOVE = 1, 2, 4, 8, 0x1000, 0x2000
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


def isolate(rank, scratch=None, shared=(), uid=None, own_pid_namespace=False):
    """Cut this rank off from the other ranks of the sandbox, then give up root for good.

    Several ranks share one sandbox (one warm interpreter is much cheaper than one per rank), so
    each rank gets its own network (none), IPC, /tmp and /dev/shm, its own pid namespace and /proc
    (`own_pid_namespace`: it sees no other rank's processes, their names or command lines), and its
    own unprivileged user
    (`uid`, which the grader chooses fresh for each submission): it cannot signal, trace or read the
    memory of another rank or of another learner's processes, nor raise any limit. The grader's
    scratch folder is hidden, but for the folders of it named in `shared` (a checkpoint folder a
    test hands every rank of a launch): any other writable place shared by ranks would be a way
    around the messages.
    """
    libc, check = _libc_call("could not isolate the rank")
    check(libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
    check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "private mounts")
    if own_pid_namespace:  # a /proc of its own pid namespace: no other rank's comm, cmdline or memory
        check(libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None), "its own /proc")
    # no pseudo-terminals: which ones exist (/dev/pts of the sandbox) is seen by every rank
    check(libc.mount(b"tmpfs", b"/dev/pts", b"tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                     b"size=4k,mode=0755"), "no pseudo-terminals")
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
    refuse_file_locks(libc, check)


# Ways for ranks to talk through files they all can read (the OS, the environment, the course): file
# locks are seen across processes (rank 1 learns the byte range of rank 0's lock on /etc/os-release
# with fcntl F_GETLK, 64 bits a lock; flock's held-or-not is a bit); which pages of such a file are in
# the page cache can be set (reading them, posix_fadvise(DONTNEED) dropping them) and read without
# touching them (preadv2's RWF_NOWAIT, io_uring, cachestat). A seccomp filter makes those calls fail
# with EPERM in a rank (no exercise needs any), and every system call of another architecture's calling
# convention (32-bit int 0x80 numbers differ). Reading a page and timing it remains (README).
# machine: (audit arch, fcntl, first x32 number or None, [flock, fadvise64, preadv2, pwritev2,
# io_uring_setup, io_uring_enter, io_uring_register, cachestat])
SECCOMP = {"x86_64": (0xC000003E, 72, 0x40000000, [73, 221, 327, 328, 425, 426, 427, 451]),
           "aarch64": (0xC00000B7, 25, None, [32, 223, 286, 287, 425, 426, 427, 451])}
LOCK_COMMANDS = (5, 6, 7, 36, 37, 38)  # F_GETLK, F_SETLK, F_SETLKW, F_OFD_GETLK, F_OFD_SETLK, F_OFD_SETLKW
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
RET_ALLOW, RET_EPERM = 0x7FFF0000, 0x00050000 | 1


def lock_filter(machine):
    """The classic BPF program of refuse_file_locks, as (code, jt, jf, k) tuples (see SECCOMP); None for
    an unknown machine."""
    if machine not in SECCOMP:
        return None
    arch, fcntl, x32, denied = SECCOMP[machine]
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    checks = [(jeq, 0, 0, c) for c in LOCK_COMMANDS]
    program = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, RET_EPERM), (ld, 0, 0, 0)]
    if x32 is not None:
        program += [(jge, 0, 1, x32), (ret, 0, 0, RET_EPERM)]
    for number in denied:
        program += [(jeq, 0, 1, number), (ret, 0, 0, RET_EPERM)]
    program += [(jeq, 1, 0, fcntl), (ret, 0, 0, RET_ALLOW),
                (ld, 0, 0, 24)]  # fcntl's command: the low half of args[1]
    for index, (code, _, _, k) in enumerate(checks):  # each: a match jumps to the EPERM at the end
        program.append((code, len(checks) - index, 0, k))
    return program + [(ret, 0, 0, RET_ALLOW), (ret, 0, 0, RET_EPERM)]


def refuse_file_locks(libc, check):
    """Install lock_filter in this process (after PR_SET_NO_NEW_PRIVS); its threads and children keep it."""
    import ctypes

    program = lock_filter(os.uname().machine)
    if program is None:
        return

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                    ("k", ctypes.c_uint32)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    filters = (Filter * len(program))(*[Filter(*f) for f in program])
    check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(Program(len(program), filters)), 0, 0),
          "no file locks")


def _rank_main(spec, fds, payload, zygote_pid):
    """The forked rank: define the learner program, join the router, run, report, exit."""
    global _namespace
    router_fd, out_w, msg_w, diag_w = fds
    code = 1
    try:
        from dpcourse.grading import routed, wire
        from dpcourse.runtime import inside_rank

        # pid 1 of its own namespace, a rank's parent is outside it: getppid() says 0
        inside_rank.die_with_parent(0 if spec.get("own_pid_namespace") else zygote_pid)
        if spec.get("probe_fd") is not None:
            inside_rank.measured_by(spec["probe_fd"])
        if spec.get("isolate"):
            isolate(spec["rank"], spec.get("scratch"), spec.get("shared", ()), spec.get("uid"),
                    spec.get("own_pid_namespace", False))
        inside_rank.redirect_output(out_w)
        import cloudpickle
        import torch

        torch.set_num_threads(1)
        faulthandler.register(signal.SIGUSR1, file=os.fdopen(diag_w, "w", closefd=False), all_threads=True)
        rank, world = spec["rank"], spec["world_size"]
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_WORLD_SIZE=str(world), DPCOURSE_GRADED_RANK="1")
        program, function = cloudpickle.loads(payload)
        if spec.get("cgroup_failed"):
            raise RuntimeError(f"the grader could not measure this rank's memory: it {spec['cgroup_failed']}")
        if spec.get("probe_fd") is not None:
            inside_rank.memory_start(spec.get("tmpfs", False))  # before any learner code: the rank's start
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


_our_pid_namespace = None  # an fd of this zygote's own pid namespace (setns back after each rank's fork)


def _new_pid_namespace_for_next_fork():
    """The next child is the first process (pid 1) of a new pid namespace (unshare(CLONE_NEWPID)
    moves the caller's children, never the caller): a rank that sees no other rank's processes, and
    whose own die with it."""
    global _our_pid_namespace
    if _our_pid_namespace is None:
        _our_pid_namespace = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    libc, check = _libc_call("could not give the rank a pid namespace of its own")
    check(libc.unshare(CLONE_NEWPID), "unshare")


def _back_to_our_pid_namespace():
    """Later children are born in this zygote's own pid namespace again (each rank gets a new one)."""
    libc, check = _libc_call("could not return to the zygote's pid namespace")
    check(libc.setns(_our_pid_namespace, CLONE_NEWPID), "setns")


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
            packet, fds, _, _ = socket.recv_fds(control, PACKET, 10)
            if not packet:
                return
            message = json.loads(packet)
            if message["cmd"] == "run":
                payload = bytearray()
                while len(payload) < message["size"]:
                    payload += control.recv(PACKET)
                fds, cgroup_fds = fds[:4], fds[4:]  # the rank's own memory cgroup (as root): see Probe
                probe = Probe(*cgroup_fds, uid=message.get("uid")) if message.get("probe") else None
                if probe is None:
                    for fd in cgroup_fds:
                        os.close(fd)
                own_namespace = bool(message.get("isolate"))  # as root: each rank its own pid namespace
                pid = None
                try:
                    if own_namespace:
                        _new_pid_namespace_for_next_fork()
                    pid = os.fork()
                except OSError as exc:  # the machine (or the submission's own limits) refused the fork
                    for fd in fds:
                        os.close(fd)
                    if probe is not None:
                        probe.close_in_child()
                        probe.forked()
                        probe.theirs.close()
                    control.send(json.dumps({"started": 0, "fork_failed": exc.errno}).encode())
                    continue
                finally:
                    if own_namespace and pid != 0:
                        _back_to_our_pid_namespace()
                if pid == 0:
                    message["own_pid_namespace"] = own_namespace
                    if probe is not None:
                        message["cgroup_failed"] = probe.enter_cgroup()  # before anything is charged here
                    control.close()
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    os.close(wake_r)
                    os.close(wake_w)
                    for other in probes.values():  # nothing of another rank's probe stays open here
                        other.close_in_child()
                    if probe is not None:
                        probe.ours.close()
                        message["probe_fd"] = probe.theirs.detach()
                        message["tmpfs"] = sandboxed  # its /tmp and /dev/shm: the sandbox's, not the host's
                    _rank_main(message, fds, bytes(payload), os.getppid())
                for fd in fds:
                    os.close(fd)
                if probe is not None:
                    probe.forked()
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
                try:
                    opened = {"opened": _open_submission(control, fds[0], (wake_r, wake_w))}
                except OSError as exc:  # the kernel refused the fork
                    os.close(fds[0])
                    opened = {"opened": 0, "fork_failed": exc.errno}
                control.send(json.dumps(opened).encode())
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
    """(anonymous, shared-memory, all) resident bytes of a process, from /proc/<pid>/status: RssAnon,
    RssShmem (pages of tmpfs files, memfds and SysV segments it has mapped) and VmRSS."""
    found = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssShmem", "VmRSS"):
                found[key] = int(value.split()[0]) * 1024
    return found.get("RssAnon", 0), found.get("RssShmem", 0), found.get("VmRSS", 0)


def tmpfs_used(fds):
    """Bytes in use on the file systems of `fds` (a rank's /tmp and /dev/shm), each counted once."""
    seen, used = set(), 0
    for fd in fds:
        try:
            info = os.fstatvfs(fd)
            device = os.fstat(fd).st_dev
        except OSError:
            continue
        if device not in seen:
            seen.add(device)
            used += (info.f_blocks - info.f_bfree) * info.f_frsize
    return used


def _cgroup_numbers(fd):
    """{name: int} of a cgroup file of "name value" lines (memory.stat), or one number (a usage)."""
    text = os.pread(fd, 1 << 16, 0).decode()
    pairs = [line.split() for line in text.splitlines() if line.strip()]
    return {p[0]: int(p[1]) for p in pairs if len(p) == 2} if len(pairs) > 1 or len(pairs[0]) == 2 else \
        {"": int(pairs[0][0])}


def _processes_of(uid):
    """The pids of this pid namespace's processes running as `uid` (a rank and what it started: as root
    each rank has a user id of its own, which no process of it can change). Read from /proc each time:
    a v1 cgroup's cgroup.procs, read again through one open file, can answer from a list a second old."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    found.append(int(entry))
            except OSError:
                continue
    return found


class Probe:
    """This zygote's end of a rank's memory probe (grader-only measurements of what a rank holds).

    The rank names moments (dpcourse.runtime.inside_rank.memory_mark: "before", "after step 0"); at
    each, while the rank waits, the zygote measures what the rank holds and keeps the number: the rank
    never sees it, so no learner code can change it. Its first message ("start", sent by the grader's
    own code in the rank just before the learner's program runs) is the rank's start. What is held:

    - as root, the rank is in a memory cgroup of its own (made by the grader for this rank, entered by
      the forked rank before it does anything: `enter_cgroup`), and holds its own RssAnon (/proc), plus
      the shared memory charged to its cgroup (memory.stat's shmem: files in its /tmp and /dev/shm,
      mapped or not, memfds, SysV segments), plus the kernel memory charged there (pipe buffers, page
      tables), plus the RssAnon of every other process of its user id (a process it started: all of its
      resident memory counts, pages it shares with the rank included). RssAnon and not the cgroup's
      anonymous charge: a forked rank's first write to each page it shares with its zygote copies the
      page and charges it to the rank (measured: ~10 MiB while a notebook's program runs), which the rank
      does not hold beyond what it started with;
    - without a cgroup, the rank's RssAnon + RssShmem (its shared mappings) + what is in use on its /tmp
      and /dev/shm (sent with its first message, when sandboxed): not what another process it started
      holds, nor a memfd or SysV segment it does not map, nor pipe buffers (README, "What the sandbox
      does not hide").

    Each mark is [label, held, anon, shared, tmpfs, other (kernel memory and other processes)]; when the
    rank exits, its exit report carries the marks, its start, how it was measured and the rank's peak
    resident memory (the kernel's count, from wait4).
    """

    MARKS = 200  # marks kept per rank
    LABEL = 60  # characters of a mark's label

    def __init__(self, procs_fd=None, stat_fd=None, kmem_fd=None, uid=None):
        self.ours, self.theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.procs_fd = procs_fd  # cgroup.procs, for the forked rank to enter its cgroup
        self.cgroup = [fd for fd in (stat_fd, kmem_fd) if fd is not None]
        self.uid = uid  # the rank's own user id (as root): the processes it starts have it too
        self.start, self.marks, self.pid, self.tmpfs = None, [], None, []

    @property
    def how(self):
        return "cgroup" if self.cgroup else ("rss+tmpfs" if self.tmpfs else "rss")

    def enter_cgroup(self):
        """In the forked rank, first of all: move into the rank's memory cgroup (None: done, or none to
        enter; else why not, and the rank then refuses to run: its memory could not be measured)."""
        if self.procs_fd is None:
            return None
        try:
            os.write(self.procs_fd, b"0")  # 0: the writing process itself
            return None
        except OSError as exc:
            return f"could not enter its memory cgroup ({exc.strerror})"
        finally:
            for fd in (self.procs_fd, *self.cgroup):
                os.close(fd)

    def close_in_child(self):
        """In a rank forked after this probe's rank: close what the zygote holds of it (another rank's
        cgroup or tmpfs would be a way to talk around the router)."""
        for fd in [self.ours.detach(), *self.tmpfs, *self.cgroup]:
            with contextlib.suppress(OSError):
                os.close(fd)

    def forked(self):
        if self.procs_fd is not None:
            os.close(self.procs_fd)
            self.procs_fd = None

    def started(self, pid, selector):
        self.pid = pid
        self.theirs.close()
        selector.register(self.ours, selectors.EVENT_READ, self)

    def measure(self):
        """[held, anon, shared, tmpfs, other] of the rank now (-1 each if it could not be read)."""
        try:
            anon, shmem, _ = memory_now(self.pid)
            if not self.cgroup:
                tmpfs = tmpfs_used(self.tmpfs)
                return [anon + shmem + tmpfs, anon, shmem, tmpfs, 0]
            stat_fd, kmem_fd = self.cgroup
            shared = _cgroup_numbers(stat_fd)["shmem"]
            other = _cgroup_numbers(kmem_fd)[""]
            for pid in _processes_of(self.uid) if self.uid is not None else ():
                if pid != self.pid:
                    with contextlib.suppress(OSError):
                        other += memory_now(pid)[0]
            return [anon + shared + other, anon, shared, 0, other]
        except (OSError, ValueError, KeyError, IndexError):
            return [-1, -1, -1, -1, -1]

    def answer(self, selector):
        try:
            label, fds, _, _ = socket.recv_fds(self.ours, 256, 2)
        except OSError:
            label, fds = b"", []
        if not label:
            selector.unregister(self.ours)
            self.ours.close()
            return
        if self.start is None:  # the grader's own first mark: the rank's start, and its tmpfs folders
            if self.cgroup:
                for fd in fds:
                    os.close(fd)
            else:
                self.tmpfs = fds
            self.start = self.measure()
        else:
            for fd in fds:
                os.close(fd)
            if len(self.marks) < self.MARKS:
                self.marks.append([label.decode(errors="replace")[:self.LABEL], *self.measure()])
        with contextlib.suppress(OSError):
            self.ours.send(b"1")

    def finished(self, usage, selector):
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(self.ours)
        self.ours.close()
        for fd in [*self.tmpfs, *self.cgroup]:
            with contextlib.suppress(OSError):
                os.close(fd)
        start = self.start or [-1] * 5
        return {"how": self.how, "start_held": start[0], "start": start, "marks": self.marks,
                "peak_rss": usage.ru_maxrss * 1024}


def _open_submission(control, fd, inherited):
    """Fork a submission's zygote: the first process of a new pid namespace (and mount namespace,
    with its own /proc), serving the control socket `fd`. Returns its pid here (0 if it failed).

    A process cannot move itself into a new pid namespace, only its later children: a middle
    process unshares, forks the submission's zygote and exits.
    """
    read_end, write_end = os.pipe()
    try:
        middle = os.fork()
    except OSError:
        os.close(read_end)
        os.close(write_end)
        raise
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
