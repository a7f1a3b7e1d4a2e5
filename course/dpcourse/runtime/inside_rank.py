"""What happens inside one rank: join the group, run the function, report back, exit.

Used by every notebook through launch, and by comm.cases and runtime.cluster.

The launcher (launcher.py) starts each rank either by forking (CPU, fast) or by
starting `python -m dpcourse.runtime.inside_rank` (GPU, or whenever CUDA is already in use
in the caller). Both paths end in `run_rank`, so a rank behaves the same way
however it was born.

Ranks talk to the launcher through three pipes:
  out   - the rank's stdout and stderr (file descriptors 1 and 2), relayed line by line;
  msg   - one framed pickle: ("ok", time, value) or ("error", time, type, message, traceback);
  diag  - faulthandler's dump of every thread's stack, written when the launcher
          sends SIGUSR1 to a rank that is stuck.
"""

import ctypes
import datetime
import faulthandler
import io
import os
import pickle
import signal
import struct
import sys
import time
import traceback

PR_SET_PDEATHSIG = 1

# A rank's report on its message pipe, and every length-prefixed message of the launcher and the
# grader's rank side: this 8-byte length (little-endian), then that many bytes.
LENGTH_PREFIX = struct.Struct("<Q")


def die_with_parent(parent_pid):
    """Ask the kernel to SIGKILL this rank when the launcher dies.

    SIGKILL, not torch's SIGINT: a background job ignores SIGINT, and a rank
    spinning in Python would be orphaned at 100% CPU (measured in FINDINGS.md).
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


_probe = None  # while graded, the socket a rank's memory marks go to (dpcourse.grading.zygote.Probe)
# called before each memory mark: what must let go of memory in flight first (the routed link's threads
# that still hold a reply: dpcourse.grading.routed registers it), so a mark measures what the rank keeps
_settle_before_mark = []
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (glibc)


def measured_by(fd):
    """Send this rank's memory marks to `fd` (the zygote measures them), and make what the rank holds
    show in its resident memory: every allocation of 64 KiB or more gets pages of its own, given back
    to the system when freed (glibc would otherwise keep freed blocks of up to 32 MiB for reuse)."""
    import socket

    global _probe
    _probe = socket.socket(fileno=fd)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None)
        libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)
        libc.mallopt(M_TRIM_THRESHOLD, 128 * 1024)


def memory_start(tmpfs):
    """The grader's own first memory mark, sent before any learner code runs in this rank: its start.
    tmpfs: send the zygote this rank's /tmp and /dev/shm too (their use counts as held memory)."""
    import socket

    fds = []
    for path in ("/tmp", "/dev/shm") if tmpfs else ():
        try:
            fds.append(os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
        except OSError:
            pass
    try:
        socket.send_fds(_probe, [b"start"], fds)
        _probe.recv(16)
    finally:
        for fd in fds:
            os.close(fd)


def settle_before_memory_marks(settle):
    """Have `settle()` called before each memory mark (the rank's routed link registers its own)."""
    _settle_before_mark[:] = [settle]


def memory_mark(label):
    """While graded with memory measured: have the zygote measure this rank's memory now, under
    `label` (the run's scaffolding marks "start", "built", "after step 0", ...). Elsewhere nothing."""
    import gc

    if _probe is None:
        return
    for settle in _settle_before_mark:
        settle()
    gc.collect()
    _probe.send(str(label).encode()[:60])
    _probe.recv(16)


def redirect_output(out_fd):
    """Send this process's fd 1 and 2 (C and Python alike) into the launcher's pipe."""
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)


def send_message(msg_fd, message):
    """Write one length-prefixed pickle; the launcher reads exactly one per rank."""
    try:
        data = pickle.dumps(message)
    except Exception as exc:  # an unpicklable return value is the learner's bug, say so
        data = pickle.dumps(("error", time.monotonic(), "PicklingError",
                             f"the function returned a value that cannot be sent back to the "
                             f"caller ({exc})", ""))
    blob = LENGTH_PREFIX.pack(len(data)) + data
    view = memoryview(blob)
    while view:
        written = os.write(msg_fd, view)
        view = view[written:]


def to_cpu(value):
    """Move tensors in a (nested) result to the CPU so the caller never has to touch CUDA."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(to_cpu(v) for v in value)
    if isinstance(value, dict) and type(value) is dict:
        return {k: to_cpu(v) for k, v in value.items()}
    return value


def join_group(rank, world_size, backend, store_path, group_timeout):
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    # Every rank of a launch lives on this machine: loopback is always the right interface.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    if backend == "nccl":
        torch.cuda.set_device(rank)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=group_timeout))
    # gloo can return from init on one rank while another is still connecting; start the
    # function on every rank together, so a rank failing at once never cuts a peer's connect.
    if backend == "nccl":
        dist.barrier(device_ids=[rank])
    else:
        dist.barrier()
    return store


class PerRank:
    """An argument of `launch` that differs by rank: rank r receives `values[r]` and nothing of the
    others' (`launch(fn, 3, per_rank([x0, x1, x2]))` calls fn(x0) on rank 0). While grading, each
    rank is sent only its own value, so a rank cannot read its peers' inputs: what it learns of
    them, it learns from messages."""

    def __init__(self, values):
        self.values = list(values)

    def __repr__(self):
        return f"per_rank({self.values!r})"


def for_rank(value, rank, world_size=None, depth=0):
    """`value` with every PerRank in it (in lists, tuples and dicts) replaced by its entry for `rank`."""
    if isinstance(value, PerRank):
        if world_size is not None and len(value.values) != world_size:
            raise ValueError(f"per_rank got {len(value.values)} values for {world_size} ranks")
        return value.values[rank]
    if depth > 8:
        return value
    if type(value) in (list, tuple):
        items = [for_rank(v, rank, world_size, depth + 1) for v in value]
        return items if type(value) is list else tuple(items)
    if type(value) is dict:
        return {k: for_rank(v, rank, world_size, depth + 1) for k, v in value.items()}
    return value


def run_rank(spec, fn, args, kwargs, msg_fd, diag_fd):
    """Run `fn` as one rank and never return: the process ends here."""
    code, store = 1, None
    try:
        fn, args, kwargs = for_rank((fn, args, kwargs), spec["rank"], spec["world_size"])
        import torch

        # A child forked after the parent used OpenMP hangs in its first big op
        # unless it drops to one thread first (FINDINGS.md). One thread per rank
        # is also the fair setting when ranks share a few cores.
        torch.set_num_threads(1)
        faulthandler.register(signal.SIGUSR1, file=os.fdopen(diag_fd, "w", closefd=False),
                              all_threads=True)
        store = join_group(spec["rank"], spec["world_size"], spec["backend"], spec["store_path"],
                           spec["group_timeout"])
        value = to_cpu(fn(*args, **kwargs))
        flush_output()
        send_message(msg_fd, ("ok", time.monotonic(), value))
        code = 0
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, even SystemExit
        send_message(msg_fd, ("error", time.monotonic(), type(exc).__name__, str(exc),
                              "".join(traceback.format_exception(exc))))
    finally:
        if code == 0:
            _leave_together(store, spec["world_size"])
        flush_output()
        os._exit(code)


def flush_output():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - nothing more to do with a broken stream
            pass


def _leave_together(store, world_size):
    """Stay until every rank has finished, then leave the group.

    A rank that exits as soon as its function returns closes its sockets while a
    slower peer may still be connecting or talking to it: the peer then fails with
    "Connection closed by peer" through no fault of its own (seen here with gloo).
    The wait goes through the store, not gloo; the launcher kills a rank that waits
    here for a peer that failed.
    """
    import torch.distributed as dist

    try:
        if store.add("dpcourse/finished", 1) == world_size:
            store.set("dpcourse/all_finished", "1")
        else:
            store.wait(["dpcourse/all_finished"], datetime.timedelta(days=1))
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the result is already sent; leaving is best effort
        pass


def spawned_main():
    """Entry point of a rank started as a fresh interpreter (GPU path)."""
    import json

    import cloudpickle

    payload_path, spec, msg_fd, diag_fd = sys.argv[1], json.loads(sys.argv[2]), *map(int, sys.argv[3:5])
    die_with_parent(spec["parent_pid"])
    sys.path[:0] = [p for p in spec["sys_path"] if p not in sys.path]  # find the caller's modules
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    with open(payload_path, "rb") as f:
        fn, args, kwargs = cloudpickle.loads(f.read())
    run_rank(spec, fn, args, kwargs, msg_fd, diag_fd)


if __name__ == "__main__":
    spawned_main()
