"""A process group whose every message goes through the grader's router: how ranks talk while graded.

Why: while grading, the learner's code runs in sandboxed rank processes that cannot reach each
other at all. The only way out of a rank is one socket to the grader's router, which delivers
each point-to-point message, computes each collective, refuses collectives in exercises built
from send/recv (whatever route the learner takes: `dist.*`, the process-group object, a
sub-group), and counts every message and byte where the learner's code cannot touch the count.

The semantics follow gloo's, so a program behaves here as it does in a notebook: a send
completes only once the matching receive is posted (every rank sending first deadlocks), a
wait that nobody answers fails after the group timeout with "Timed out waiting ...", and
collectives on a group match in the order each rank calls them.

Only the grader uses this module (notebooks use gloo or NCCL through `dpcourse.launch`).
"""

import datetime
import itertools
import socket
import threading
import time

import torch
import torch.distributed as dist
from torch.futures import Future
from torch.utils._python_dispatch import _disable_current_modes

from dpcourse.comm.recorder import (
    ForbiddenCollective,
    check_all_to_all_splits,
    check_peer,
    check_tensor_layout,
    check_tensor_lists,
    note_routed_call,
)
from dpcourse.grading import wire
from dpcourse.runtime import inside_rank

BACKEND = "dpcourse-routed"
_link = None  # this rank's Link, once joined


class Link:
    """This rank's connection to the router: requests out, replies in, waits bounded."""

    def __init__(self, sock, timeout):
        self.sock, self.timeout = sock, timeout
        self.lock, self.pending = threading.Lock(), {}  # seq -> (future, what, deadline, on_reply)
        self.acks = {}  # seq -> Future of the router's immediate verdict on a collective
        self.seq = itertools.count(1)
        # frames the reader or a reply thread still holds: a memory mark waits until none is (`settle`)
        self.in_hand, self.settled = 0, threading.Condition()
        threading.Thread(target=self._read, name="dpcourse-router-reader", daemon=True).start()
        threading.Thread(target=self._watch, name="dpcourse-router-watchdog", daemon=True).start()

    def request(self, header, tensors, what, on_reply, ack=False):
        """Send one request; return (future completed by the router's reply, ack future or None)."""
        seq = next(self.seq)
        future = Future()
        ack_future = Future() if ack else None
        try:
            with self.lock:
                self.pending[seq] = (future, what, time.monotonic() + self.timeout, on_reply)
                if ack_future is not None:
                    self.acks[seq] = ack_future
                # the frame's copy of the tensors is the grader's, not the rank's program's: made outside
                # the rank's dispatch modes, so that what a rank measures of itself (notebook 12's
                # PeakMemory, its FLOP counter) is what it measures under gloo
                with _disable_current_modes():
                    frame = wire.encode(dict(header, seq=seq), tensors)
                self.sock.sendall(frame)
                del frame
        except OSError:
            refused = self._refusal(future)
            if refused is None:
                raise
            raise RuntimeError(refused) from None
        return future, ack_future

    def _refusal(self, future):
        """The router stops reading a rank whose message is larger than the exercise can need, and its
        reply says so: that is the error to raise, not the broken pipe it leaves. None: no such reply."""
        end = time.monotonic() + self.REFUSAL_WAIT
        while not future.done() and time.monotonic() < end:
            time.sleep(0.01)
        if not future.done():
            return None
        try:
            future.wait()
        except RuntimeError as exc:
            return str(exc)
        return None

    REFUSAL_WAIT = 2.0  # seconds a failed send waits for the router's reply saying why

    def _read(self):
        try:
            while True:
                frame = wire.read_frame(self.sock)
                if frame is None:
                    break
                self._hold()
                try:
                    self._deliver(*frame)
                finally:
                    del frame  # not kept until the next reply: what a rank holds is measured while graded
                    self._release()
        except (OSError, wire.WireError):
            pass
        self._fail_all("the grader's message router closed the connection")

    def _deliver(self, header, tensors):
        seq = header.get("seq")
        if header.get("k") == "ack":
            with self.lock:
                ack = self.acks.pop(seq, None)
            if ack is not None:
                ack.set_result(header.get("refused"))
            return
        with self.lock:
            entry = self.pending.pop(seq, None)
            ack = self.acks.pop(seq, None)
        if ack is not None:
            ack.set_result(None)
        if entry is None:
            return
        # Complete the future on a thread of its own: callbacks chained with .then() run where the
        # future completes, and one may wait for another reply (torch's powerSGD_hook does) that this
        # reader thread would then never deliver.
        self._hold()
        box = [entry, header, tensors]  # emptied by the thread: its Thread object keeps its args to the end
        threading.Thread(target=self._complete_and_release, args=(box,), daemon=True).start()

    def _complete_and_release(self, box):
        future, outcome = self._outcome(*box)
        box.clear()
        # Nothing of the rank's is held here any more but `outcome` (a collective's outputs, which its
        # future keeps anyway): once the rank's wait returns, this thread keeps none of its buffers
        # alive, as gloo's does not -- what a rank holds is measured while graded.
        try:
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)
        finally:
            del future, outcome
            self._release()

    def _hold(self):
        with self.settled:
            self.in_hand += 1

    def _release(self):
        with self.settled:
            self.in_hand -= 1
            self.settled.notify_all()

    def settle(self, timeout=5.0):
        """Wait until no thread of this link holds a frame (a reply being handed over): before a memory
        mark, so that what is measured is what the rank's own code keeps."""
        with self.settled:
            self.settled.wait_for(lambda: self.in_hand == 0, timeout)

    @staticmethod
    def _outcome(entry, header, tensors):
        """(future, its result or exception) of a reply, worked out before the future completes."""
        future, _, _, on_reply = entry
        if header.get("k") == "error":
            return future, RuntimeError(header.get("msg", "the router refused the call"))
        try:
            return future, on_reply(tensors)
        except Exception as exc:  # noqa: BLE001 - a mismatch (size, dtype) is the caller's error
            return future, exc

    def _watch(self):
        """Fail every wait that outlived the group timeout, as gloo does."""
        while True:
            time.sleep(0.05)
            now = time.monotonic()
            with self.lock:
                late = [(s, e) for s, e in self.pending.items() if e[2] < now]
                for seq, _ in late:
                    del self.pending[seq]
            for _, (future, what, _, _) in late:
                future.set_exception(RuntimeError(
                    f"Timed out waiting {self.timeout * 1000:.0f}ms for {what}"))

    def _fail_all(self, message):
        with self.lock:
            entries, self.pending = list(self.pending.values()), {}
            acks, self.acks = list(self.acks.values()), {}
        for ack in acks:
            ack.set_result(message)
        for future, *_ in entries:
            future.set_exception(RuntimeError(message))


class RoutedWork(dist.Work):
    """A request in flight. Not torch's future-wrapping Work: its wait() returns True even when the
    future failed, so a timeout or a refused call would pass silently; this one raises, as gloo's."""

    def __init__(self, future, p2p=False, holds=()):
        super().__init__()
        self.future, self.p2p, self.waited = future, p2p, False
        # gloo's send and recv requests keep their tensor alive for as long as the request object lives,
        # waited for or not (measured, torch 2.13), and no longer: so does this one, and its future
        # (completed by the reader's thread) keeps nothing of the rank's
        self.holds = list(holds)

    def wait(self, timeout=None):
        self.future.wait()  # raises what the router or the watchdog set
        self.waited = True
        return True

    def is_completed(self):
        # gloo's send and recv requests say "completed" only once waited for (measured, torch 2.13): code
        # that drops requests it believes done must keep them here as it does in a notebook
        return self.future.done() and (self.waited or not self.p2p)

    def is_success(self):
        return self.future.done() and self.exception() is None

    def exception(self):
        try:
            self.future.value()
        except Exception as exc:  # noqa: BLE001
            return exc
        return None

    def get_future(self):
        return self.future


def _work(future, p2p=False, holds=()):
    return RoutedWork(future, p2p, holds)


def _copy_into(targets, result=True):
    """A reply handler that copies the router's tensors into `targets` (checking shapes); its result is
    `targets` (result=False: None, for a receive, whose request holds its buffer itself)."""
    def on_reply(tensors):
        if len(tensors) != len(targets):
            raise RuntimeError(f"expected {len(targets)} tensor(s) back, got {len(tensors)}")
        for target, value in zip(targets, tensors, strict=True):
            if target.numel() != value.numel():
                raise RuntimeError(f"message size mismatch: a buffer of {target.numel()} elements "
                                   f"received {value.numel()}")
            with torch.no_grad():
                target.copy_(value.reshape(target.shape).to(target.dtype))
        return targets if result else None
    return on_reply


class RoutedGroup(dist.ProcessGroup):
    """One process group (the world or a sub-group) whose calls all go to the router."""

    def __init__(self, rank, size, members, name):
        super().__init__(rank, size)
        self.members, self.group_name_ = list(members), name

    def getBackendName(self):
        return BACKEND

    @property
    def group_name(self):
        """torch reads a group's name from its C++ backend, which a Python group has none of:
        DeviceMesh and the functional collectives (DTensor's) look groups up by this name."""
        return self.group_name_

    # -- point to point -------------------------------------------------------------------
    def _other(self, group_rank):
        """The world rank of a peer; like gloo, a rank has no connection to itself."""
        if group_rank == self.rank():
            raise RuntimeError(f"Pair is not connected: rank {self.members[group_rank]} has no connection "
                               f"to itself")
        return self.members[group_rank]

    def send(self, tensors, dst, tag=0):
        check_peer("send", dst, self.size(), self.members)  # as the recorder does before gloo sees it
        note_routed_call("send", dst, tensors[:1], self.members)
        peer = self._other(dst)
        future, _ = _link.request({"k": "send", "group": self.members, "dst": peer, "tag": tag},
                                  tensors[:1], f"send to rank {peer}", lambda _: None)
        return _work(future, p2p=True, holds=tensors[:1])

    def recv(self, tensors, src, tag=0):
        check_peer("recv", src, self.size(), self.members)  # -1 would index the last member
        note_routed_call("recv", src, tensors[:1], self.members)
        peer = self._other(src)
        t = tensors[0]
        future, _ = _link.request({"k": "recv", "group": self.members, "src": peer, "tag": tag,
                                   "numel": t.numel()}, (), f"recv from rank {peer}",
                                  _copy_into([t], result=False))
        return _work(future, p2p=True, holds=[t])

    def recv_anysource(self, tensors, tag=0):
        raise RuntimeError("receiving from any source is not supported while grading: name the sender")

    # -- collectives ------------------------------------------------------------------------
    def _collective(self, op, inputs, outputs, params=None):
        note_routed_call(op, None, inputs, self.members)
        header = {"k": "coll", "group": self.members, "op": op, "params": params or {}}
        future, ack = _link.request(header, inputs, f"{op} on the group of ranks {self.members}",
                                    _copy_into(outputs), ack=True)
        refused = ack.wait()
        if refused:
            raise ForbiddenCollective(refused)
        return _work(future)

    def allreduce(self, tensors, opts=None):
        return self._collective("all_reduce", tensors, tensors, {"reduce": _reduce_op(opts)})

    def allreduce_coalesced(self, tensors, opts=None):
        return self._collective("all_reduce", tensors, tensors, {"reduce": _reduce_op(opts)})

    def reduce(self, tensors, opts):
        return self._collective("reduce", tensors, tensors,
                                {"reduce": _reduce_op(opts), "root": opts.rootRank})

    def broadcast(self, tensors, opts):
        return self._collective("broadcast", tensors, tensors, {"root": opts.rootRank})

    def barrier(self, opts=None):
        return self._collective("barrier", [], [])

    def allgather(self, output_lists, inputs, opts=None):
        # as the recorder does before gloo sees it
        check_tensor_lists("all_gather", {"output": output_lists[0] if output_lists else []}, self.size())
        outputs = [t for lst in output_lists for t in lst]
        return self._collective("all_gather", inputs, outputs)

    def all_gather_single(self, output, input, opts=None):
        """dist.all_gather_into_tensor (torch 2.13 calls the group's all_gather_single); the layouts gloo
        accepts, and no other (recorder.check_tensor_layout)."""
        check_tensor_layout("all_gather_into_tensor", output, input, self.size())
        return self._collective("all_gather_into_tensor", [input], _rows(output, self.size()))

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self._collective("all_gather_into_tensor", inputs,
                                [c for o in outputs for c in _rows(o, self.size())])

    _allgather_base = all_gather_single  # the names of torch releases before 2.13
    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        check_tensor_lists("reduce_scatter", {"input": input_lists[0] if input_lists else []}, self.size())
        inputs = [t for lst in input_lists for t in lst]
        return self._collective("reduce_scatter", inputs, outputs, {"reduce": _reduce_op(opts)})

    def reduce_scatter_single(self, output, input, opts=None):
        """dist.reduce_scatter_tensor (torch 2.13 calls the group's reduce_scatter_single); the layouts gloo
        accepts, and no other (recorder.check_tensor_layout)."""
        check_tensor_layout("reduce_scatter_tensor", output, input, self.size())
        return self._collective("reduce_scatter_tensor", _rows(input, self.size()), [output],
                                {"reduce": _reduce_op(opts)})

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self._collective("reduce_scatter_tensor", [c for t in inputs for c in _rows(t, self.size())],
                                list(outputs), {"reduce": _reduce_op(opts)})

    _reduce_scatter_base = reduce_scatter_single

    def gather(self, output_lists, inputs, opts):
        outputs = [t for lst in output_lists for t in lst]
        return self._collective("gather", inputs, outputs, {"root": opts.rootRank})

    def scatter(self, outputs, input_lists, opts):
        inputs = [t for lst in input_lists for t in lst]
        return self._collective("scatter", inputs, outputs, {"root": opts.rootRank})

    def alltoall(self, outputs, inputs, opts=None):
        check_tensor_lists("all_to_all", {"output": outputs, "input": inputs}, self.size())
        return self._collective("all_to_all", inputs, outputs)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """dist.all_to_all_single, even or uneven splits along the first dimension."""
        check_all_to_all_splits(output, input, output_split_sizes, input_split_sizes, self.size())
        ins = list(input.split(input_split_sizes or [input.shape[0] // self.size()] * self.size()))
        outs = list(output.split(output_split_sizes or [output.shape[0] // self.size()] * self.size()))
        return self._collective("all_to_all_single", ins, outs)

    alltoall_base = all_to_all_single


def _rows(tensor, n):
    """A tensor of n equal parts as n views, written in place by the reply (dim 0 split n ways)."""
    if tensor.numel() % n:
        raise RuntimeError(f"a tensor of {tensor.numel()} elements cannot be split into {n} equal parts")
    return list(tensor.view(n, -1).unbind(0))


def _reduce_op(opts):
    op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
    name = str(getattr(op, "op", op)).rsplit(".", 1)[-1].lower()
    return name


def _create(options, backend_options):
    members = list(options.global_ranks_in_group or range(options.group_size))
    return RoutedGroup(options.group_rank, options.group_size, members, str(options.group_id))


def join(sock, rank, world_size, group_timeout):
    """Make `sock` this rank's only way to talk, and initialise the default group over it."""
    global _link
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
    _link = Link(sock, group_timeout)
    inside_rank.settle_before_memory_marks(_link.settle)
    # DDP asks the C++ backend to compare parameter shapes across ranks; a Python process group
    # has no C++ backend, and the check is a convenience, so it is skipped here.
    import torch.nn.parallel.distributed as ddp

    ddp._verify_param_shape_across_processes = lambda *args, **kwargs: None
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=group_timeout))


def socket_from_fd(fd):
    return socket.socket(fileno=fd)
