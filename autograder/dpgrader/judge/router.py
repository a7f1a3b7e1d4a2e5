"""The grader's message router: the one way graded ranks can talk, and the count of what they said.

Each graded rank holds one socket to this router (see dpcourse.grading.routed, the rank side).
The router matches every send with its receive (a send completes only when its receive is
posted, as with gloo), computes every collective from the members' contributions, refuses
collectives where an exercise allows point-to-point calls only, and writes every call to a log
that lives here, in the grader's process, where the learner's code cannot reach it.

The log is per rank, in the order the rank made its calls: `CommOp` records (op, peer as a group
rank, bytes, group as world ranks), the same records the in-rank recorder gives in a notebook.
"""

import collections
import contextlib
import socket
import threading
import time

import torch

from dpcourse.comm.recorder import CommOp
from dpcourse.grading import wire

# the reductions gloo offers (torch 2.13: ReduceOp.AVG too, on all_reduce, reduce and reduce_scatter)
REDUCE = {"sum": lambda ts: _fold(ts, torch.add), "product": lambda ts: _fold(ts, torch.mul),
          "min": lambda ts: _fold(ts, torch.minimum), "max": lambda ts: _fold(ts, torch.maximum),
          "band": lambda ts: _fold(ts, torch.bitwise_and), "bor": lambda ts: _fold(ts, torch.bitwise_or),
          "bxor": lambda ts: _fold(ts, torch.bitwise_xor), "avg": lambda ts: _average(ts)}


def _fold(tensors, op):
    acc = tensors[0].clone()
    for t in tensors[1:]:
        acc = op(acc, t.to(acc.dtype))
    return acc


def _average(tensors):
    total = _fold(tensors, torch.add)
    return (total / len(tensors)).to(total.dtype) if total.is_floating_point() else total // len(tensors)


def _reducer(op, params):
    """The reduction every member asked for, or the error gloo gives (every member gets it)."""
    name = params.get("reduce", "sum")
    if name not in REDUCE:
        raise ValueError(f"{op}: Cannot use ReduceOp.{str(name).upper()} with Gloo")
    return REDUCE[name]


MAX_MESSAGE = 64 << 20  # bytes of one message (a rank's frame) the router reads
MAX_WAITING = 256 << 20  # bytes of messages and collective inputs the router holds for one launch


class Router:
    """Serve the sockets of one launch's ranks until they close; keep the log of every call.

    What the router holds is bounded, so that learner code cannot grow the grader: a frame larger
    than `max_message` is refused before its body is read (the rank's call fails, saying so), and
    sends waiting for their receive plus collective inputs waiting for their group may hold at
    most `max_waiting` bytes at once.
    """

    def __init__(self, sockets, p2p_only=False, exercise="this exercise", max_message=MAX_MESSAGE,
                 max_waiting=MAX_WAITING, keep_messages=None, **_):
        self.sockets, self.p2p_only, self.exercise = sockets, p2p_only, exercise
        # What each message carried, for checks of where a rank's data came from (dpcourse.comm.
        # provenance): ("post", src, dst, id, tensor) when a send arrives, ("deliver", src, dst, id,
        # tensor) when the router hands it to its receiver; kept in point-to-point exercises, and for
        # collectives (CommOp.payload) when asked.
        self.keep_messages = p2p_only if keep_messages is None else keep_messages
        self.flow, self.sent = [], 0
        self.max_message, self.max_waiting, self.waiting = max_message, max_waiting, 0
        self.world = len(sockets)
        self.locks = [threading.Lock() for _ in sockets]
        self.state = threading.Lock()
        self.sends = collections.defaultdict(collections.deque)  # (group, src, dst, tag) -> sends
        self.recvs = collections.defaultdict(collections.deque)  # same key -> posted receives
        self.slots = collections.defaultdict(dict)  # (group, index) -> {rank: contribution}
        self.calls_on = collections.Counter()  # (rank, group) -> collectives called so far
        self.log = [[] for _ in sockets]  # per rank: CommOp in call order
        self.protocol_errors = []  # (rank, what) for frames that broke the protocol
        self.threads = [threading.Thread(target=self._serve, args=(r,), daemon=True,
                                         name=f"router-rank-{r}") for r in range(self.world)]
        for thread in self.threads:
            thread.start()

    def join(self, timeout):
        end = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, end - time.monotonic()))

    # -- reading ----------------------------------------------------------------------------
    def _serve(self, rank):
        sock = self.sockets[rank]
        try:
            while True:
                try:
                    frame = wire.read_frame(sock, self.max_message)
                except wire.FrameTooLarge as exc:
                    seq = (exc.header or {}).get("seq")
                    self.protocol_errors.append((rank, str(exc)))
                    self._reply(rank, {"k": "error", "seq": seq, "msg": (
                        f"rank {rank} sent {exc}: no message of {self.exercise} needs that much (the "
                        f"grader stopped reading this rank)")})
                    # and says so at once: a rank blocked writing the rest of the message gets an error
                    # now, rather than waiting for the launch's deadline (the reply stays readable)
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RD)
                    return
                if frame is None:
                    return
                header, tensors = frame
                try:
                    self._handle(rank, header, tensors)
                except (KeyError, TypeError, ValueError, IndexError) as exc:
                    self.protocol_errors.append((rank, f"{type(exc).__name__}: {exc}"))
                    self._reply(rank, {"k": "error", "seq": header.get("seq"),
                                       "msg": f"the grader's router could not read this call ({exc})"})
        except (OSError, wire.WireError) as exc:
            self.protocol_errors.append((rank, str(exc)))

    def _handle(self, rank, header, tensors):
        kind, seq = header["k"], header["seq"]
        group = tuple(int(m) for m in header["group"])
        if rank not in group or len(set(group)) != len(group) or not all(0 <= m < self.world for m in group):
            raise ValueError(f"rank {rank} used a group {list(group)} it does not belong to")
        if kind == "send":
            self._send(rank, seq, group, int(header["dst"]), int(header["tag"]), tensors)
        elif kind == "recv":
            self._recv(rank, seq, group, int(header["src"]), int(header["tag"]), int(header["numel"]))
        elif kind == "coll":
            self._collective(rank, seq, group, str(header["op"]), dict(header["params"]), tensors)
        else:
            raise ValueError(f"unknown request {kind!r}")

    # -- point to point -----------------------------------------------------------------------
    def _send(self, rank, seq, group, dst, tag, tensors):
        if dst not in group or dst == rank or len(tensors) != 1:
            raise ValueError(f"rank {rank} sent to rank {dst}, which is not another member of its group")
        op = CommOp("send", group.index(dst), _nbytes(tensors[0]), time.perf_counter(), None, group)
        op.tag = tag
        with self.state:
            self.log[rank].append(op)
            if self.keep_messages:
                op.message = self.sent
                self.sent += 1
                self.flow.append(("post", rank, dst, op.message, tensors[0]))
            key = (group, rank, dst, tag)
            if self.recvs[key]:
                self._deliver(key, (rank, seq, tensors[0], op), self.recvs[key].popleft())
            elif self._hold(rank, seq, op.nbytes):
                self.sends[key].append((rank, seq, tensors[0], op))

    def _recv(self, rank, seq, group, src, tag, numel):
        if src not in group or src == rank:
            raise ValueError(f"rank {rank} received from rank {src}, which is not another member of "
                             f"its group")
        op = CommOp("recv", group.index(src), 0, time.perf_counter(), None, group)
        op.tag = tag
        with self.state:
            self.log[rank].append(op)
            key = (group, src, rank, tag)
            if self.sends[key]:
                send = self.sends[key].popleft()
                self.waiting -= send[3].nbytes
                self._deliver(key, send, (rank, seq, numel, op))
            else:
                self.recvs[key].append((rank, seq, numel, op))

    def _hold(self, rank, seq, nbytes):
        """Count `nbytes` more held here (under self.state); False, with the call refused, past the limit."""
        if self.waiting + nbytes > self.max_waiting:
            self._reply(rank, {"k": "error", "seq": seq, "msg": (
                f"rank {rank}'s message of {nbytes} bytes would make more than {self.max_waiting >> 20} MiB "
                f"of messages wait for their receives at once: no step of {self.exercise} needs that")})
            return False
        self.waiting += nbytes
        return True

    def _deliver(self, key, send, recv):
        src, send_seq, tensor, send_op = send
        dst, recv_seq, numel, recv_op = recv
        now = time.perf_counter()
        recv_op.nbytes, send_op.end, recv_op.end = _nbytes(tensor), now, now
        if tensor.numel() != numel:
            message = (f"Received data size doesn't match expected size: rank {src} sent {tensor.numel()} "
                       f"elements to rank {dst}, whose receive buffer holds {numel}")
            self._reply(dst, {"k": "error", "seq": recv_seq, "msg": message})
            self._reply(src, {"k": "error", "seq": send_seq, "msg": message})
            return
        if self.keep_messages:
            self.flow.append(("deliver", src, dst, send_op.message, tensor))
        self._reply(dst, {"k": "done", "seq": recv_seq}, [tensor])
        self._reply(src, {"k": "done", "seq": send_seq})

    # -- collectives --------------------------------------------------------------------------
    def _collective(self, rank, seq, group, op, params, tensors):
        record = CommOp(op, None, sum(_nbytes(t) for t in tensors), time.perf_counter(), None, group)
        if self.keep_messages:
            record.payload = list(tensors)
        with self.state:
            self.log[rank].append(record)
        if self.p2p_only:
            record.refused = True
            self._reply(rank, {"k": "ack", "seq": seq, "refused": (
                f"{self.exercise} called the collective `{op}`: it must be built from point-to-point "
                f"operations only (dist.send/recv/isend/irecv or batch_isend_irecv)")})
            return
        with self.state:
            held = self._hold(rank, seq, record.nbytes)
        if not held:
            return  # its error reply settles the call
        self._reply(rank, {"k": "ack", "seq": seq, "refused": None})
        with self.state:
            index = self.calls_on[(rank, group)]
            self.calls_on[(rank, group)] += 1
            slot = self.slots[(group, index)]
            slot[rank] = (seq, op, params, tensors, record)
            if len(slot) < len(group):
                return
            del self.slots[(group, index)]
            self.waiting -= sum(slot[r][4].nbytes for r in group)
        self._complete(group, index, slot)

    def _complete(self, group, index, slot):
        ops = {r: slot[r][1] for r in group}
        now = time.perf_counter()
        for r in group:
            slot[r][4].end = now
        try:
            if len(set(ops.values())) > 1 or len({repr(slot[r][2]) for r in group}) > 1:
                calls = ", ".join(f"rank {r} called {ops[r]}{_params(slot[r][2])}" for r in group)
                raise ValueError(f"the ranks of group {list(group)} called different collectives at their "
                                 f"call number {index + 1} on it: {calls}")
            results = _compute(ops[group[0]], group, {r: slot[r][2] for r in group},
                               {r: slot[r][3] for r in group})
        except (ValueError, RuntimeError, IndexError) as exc:
            for r in group:
                self._reply(r, {"k": "error", "seq": slot[r][0], "msg": str(exc)})
            return
        for r in group:
            self._reply(r, {"k": "done", "seq": slot[r][0]}, results[r])

    def _reply(self, rank, header, tensors=()):
        data = wire.encode(header, tensors)
        try:
            with self.locks[rank]:
                self.sockets[rank].sendall(data)
        except OSError:
            pass  # the rank is gone; its launch reports why

    def ops_of(self, rank):
        return list(self.log[rank])


def _params(params):
    return f" ({', '.join(f'{k}={v}' for k, v in sorted(params.items()))})" if params else ""


def _nbytes(t):
    return t.numel() * t.element_size()


def _same_shapes(inputs, what):
    shapes = {r: [tuple(t.shape) for t in ts] for r, ts in inputs.items()}
    if len({repr(s) for s in shapes.values()}) > 1:
        detail = ", ".join(f"rank {r}: {s}" for r, s in shapes.items())
        raise ValueError(f"{what}: the ranks passed tensors of different shapes ({detail})")


SAME_AS = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
           "all_to_all_single": "all_to_all"}  # the tensor forms compute like the list forms


def _compute(op, group, params, inputs):
    """Each member's result tensors for one collective, from every member's inputs."""
    n = len(group)
    op = SAME_AS.get(op, op)
    if op == "barrier":
        return {r: [] for r in group}
    if op in ("all_reduce", "reduce"):
        _same_shapes(inputs, op)
        reduce = _reducer(op, params[group[0]])
        k = len(inputs[group[0]])
        totals = [reduce([inputs[r][i] for r in group]) for i in range(k)]
        if op == "all_reduce":
            return {r: totals for r in group}
        root = group[params[group[0]]["root"]]
        return {r: totals if r == root else inputs[r] for r in group}
    if op == "broadcast":
        _same_shapes(inputs, op)
        root = group[params[group[0]]["root"]]
        return {r: inputs[root] for r in group}
    if op == "all_gather":
        _same_shapes(inputs, op)
        k = len(inputs[group[0]])
        return {r: [inputs[m][i] for i in range(k) for m in group] for r in group}
    if op == "reduce_scatter":
        _same_shapes(inputs, op)
        reduce = _reducer(op, params[group[0]])
        per = len(inputs[group[0]]) // n
        return {r: [reduce([inputs[m][j * n + group.index(r)] for m in group]) for j in range(per)]
                for r in group}
    if op == "gather":
        root = group[params[group[0]]["root"]]
        return {r: [inputs[m][0] for m in group] if r == root else [] for r in group}
    if op == "scatter":
        root = group[params[group[0]]["root"]]
        return {r: [inputs[root][group.index(r)]] for r in group}
    if op == "all_to_all":
        return {r: [inputs[m][group.index(r)] for m in group] for r in group}
    raise ValueError(f"the collective {op} is not supported while grading")
