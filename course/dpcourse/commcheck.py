"""Run a communication exercise on ranks under the recorder, and judge values, messages and bytes.

    calls = run_p2p(ring_shift, [torch.full((3,), float(r)) for r in range(4)], exercise="ring_shift")
    calls[2].result, calls[2].after, calls[2].ops      # what rank 2 returned, its input after, its calls
    expect_ring_traffic(calls, numel=3, element_size=4, phases=2, what="ring_all_reduce")

Why a module: the exercises of notebooks 03-04 are graded on three things -- the values
each rank ends with, that only point-to-point calls were used (a collective would do the
work for you), and how many messages and bytes each rank sent (a ring is *defined* by
them). Each rank runs the learner's function inside `CommRecorder(p2p_only=True)`, so the
same recorder that forbids `dist.all_reduce` and the process-group bypass also counts
every `send` and `recv` with its peer and size.

A deadlock must end in seconds with a sentence naming the ranks and the call each was
stuck in, not with gloo's internals: every rank catches its own timeout ("Timed out
waiting 3000ms for recv") or the "connection closed" it gets once a peer gives up, and
reports which call it was blocked in. The caller turns that into one AssertionError.
"""

import math
import re
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ._rank import to_cpu
from .checks import describe
from .env import rank_device
from .launcher import launch
from .recorder import CommRecorder, ForbiddenCollective

GROUP_TIMEOUT = 3.0  # seconds a blocked send/recv waits before it counts as a deadlock
WAITED = re.compile(r"timed out|timeout|closed by peer|connection reset|broken pipe|connection closed"
                    r"|socket closed|connection refused", re.I)


@dataclass
class Call:
    """What one rank did in one call of the learner's function."""

    rank: int  # rank in the world
    group_rank: int | None  # rank in the group the call ran on; None: not a member, did not call
    group_members: list | None = None  # world ranks of that group, in group-rank order
    result: object = None  # what the function returned
    after: object = None  # the first argument as the call left it (in-place functions)
    expected: object = None  # the reference computed with a built-in collective, if asked
    ops: list = field(default_factory=list)  # CommOp list: op, peer (group rank), nbytes
    stuck: str | None = None  # "in recv from rank 3 (`dist.recv(buf, left)`)" after a timeout
    forbidden: str | None = None  # the ForbiddenCollective message

    @property
    def group_size(self):
        return len(self.group_members or ())

    @property
    def sends(self):
        return [o for o in self.ops if o.op == "send"]

    @property
    def sent_bytes(self):
        return sum(o.nbytes for o in self.sends)


def run_p2p(fn, inputs, *, exercise, args=(), kwargs=None, reference=None, groups=None,
            group_timeout=GROUP_TIMEOUT, deadline=None, label=None):
    """Launch len(inputs) ranks; rank r calls fn(inputs[r], *args, **kwargs) with p2p only.

    inputs[r] goes to rank r's device and is cloned, so `Call.after` shows what an in-place
    function did to it. reference="all_reduce" also computes the expected value with
    `dist.all_reduce` (outside the recorder). groups: lists of world ranks; each rank calls
    fn with `group=` the group it belongs to. Returns one Call per world rank; raises an
    AssertionError naming ranks and calls on a deadlock or a collective.
    """
    case = dict(inputs=list(inputs), args=tuple(args), kwargs=dict(kwargs or {}), reference=reference,
                groups=groups, label=label)
    return next(run_cases(fn, len(inputs), [case], exercise=exercise, group_timeout=group_timeout,
                          deadline=deadline))


def run_cases(fn, world_size, cases, *, exercise, group_timeout=GROUP_TIMEOUT, deadline=None):
    """Several cases on the same ranks in one launch (a launch costs ~0.1-0.5 s, a case ~ms).

    Each case is a dict like run_p2p's arguments: inputs (one per world rank), args, kwargs,
    reference, groups, label. Yields, case by case, the list of Calls (one per world rank);
    a deadlock or a collective in a case raises when that case is reached, so a caller that
    checks each case as it comes reports the first thing that went wrong.
    """
    per_rank = launch(_rank_side, world_size, fn, cases, exercise, group_timeout=group_timeout,
                      deadline=deadline)
    for index, case in enumerate(cases):
        calls = [rank_calls[index] if index < len(rank_calls) else None for rank_calls in per_rank]
        _raise_problems(calls, exercise, case.get("label"), group_timeout)
        yield calls


class PeerRecorder(CommRecorder):
    """A CommRecorder that also notes each send/recv's peer as a world rank (`op.world_peer`):
    the recorder sees the peer's rank in the group the call was made on."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func.overloadpacket._qualified_op_name in ("c10d::send", "c10d::recv_") and self.ops:
            self.ops[-1].world_peer = _world_rank(args[1], args[2])
        return out


def _world_rank(process_group, peer):
    try:
        group = torch._C._distributed_c10d.ProcessGroup.unbox(process_group)
        return dist.get_process_group_ranks(group)[peer]
    except Exception:  # noqa: BLE001 - a name for a message only: fall back to the group rank
        return peer


def world_peer(op):
    """The world rank a send went to / a recv came from."""
    return getattr(op, "world_peer", op.peer)


def _rank_side(fn, cases, exercise):
    """Runs on every rank: each case in order, stopping at the first one that went wrong."""
    rank, calls = dist.get_rank(), []
    for case in cases:
        group, members = _make_group(case.get("groups"), rank)
        call = Call(rank, None)
        calls.append(call)
        if members is None:
            continue
        call.group_rank, call.group_members = members.index(rank), members
        x = _to_device(case["inputs"][rank])
        kwargs = dict(case.get("kwargs") or {})
        if case.get("groups") is not None:
            kwargs["group"] = group
        if case.get("reference") == "all_reduce":
            call.expected = x.clone()
            dist.all_reduce(call.expected, group=group)
        recorder = PeerRecorder(p2p_only=True, exercise=exercise)
        try:
            with recorder:
                call.result = fn(x, *case.get("args", ()), **kwargs)
        except ForbiddenCollective as exc:
            call.forbidden = str(exc)
        except Exception as exc:  # a timeout or a vanished peer is a deadlock; anything else is a bug
            if isinstance(exc, RuntimeError) and "Pair is not connected" in str(exc):
                raise RuntimeError(f"{exercise}: rank {rank} sent to or received from itself (gloo: \"Pair "
                                   f"is not connected\"): a rank has no connection to itself; on a single "
                                   f"rank there is nobody to talk to") from exc
            if not (isinstance(exc, RuntimeError) and WAITED.search(str(exc))):
                raise
            call.stuck = _blocked_in(exc, recorder.ops)
        call.ops = recorder.ops
        call.result, call.after, call.expected = to_cpu(call.result), to_cpu(x), to_cpu(call.expected)
        if call.stuck or call.forbidden:
            break  # peers will not match the next case's calls: stop here, report this one
    return calls


def _make_group(groups, rank):
    """Create every group (all ranks must take part), return (this rank's group, its members)."""
    if groups is None:
        return None, list(range(dist.get_world_size()))
    mine = (None, None)
    for members in groups:
        group = dist.new_group(list(members))
        if rank in members:
            mine = (group, list(members))
    return mine


def _to_device(value):
    return value.to(rank_device()).clone() if isinstance(value, torch.Tensor) else value


def _blocked_in(exc, ops):
    """Which call a rank was blocked in, from its traceback and the recorder's last calls."""
    frames = traceback.extract_tb(exc.__traceback__)
    c10d = [f for f in frames
            if f.filename.replace("\\", "/").endswith("torch/distributed/distributed_c10d.py")]
    call = c10d[0].name if c10d else "wait"
    user = [f for f in frames if "site-packages" not in f.filename and "/dpcourse/" not in f.filename]
    where = f" (`{user[-1].line.strip()}`)" if user and user[-1].line else ""
    last = ops[-1] if ops else None
    if call in ("send", "recv", "isend", "irecv") and last is not None and last.op in ("send", "recv"):
        direction = "to" if last.op == "send" else "from"
        return f"in {call} {direction} rank {world_peer(last)}{where}"
    recent = ", ".join(f"{o.op} {'to' if o.op == 'send' else 'from'} rank {world_peer(o)}" for o in ops[-2:])
    return f"in {call}(){where}" + (f", after {recent}" if recent else "")


def _raise_problems(calls, exercise, label, group_timeout):
    where = f" ({label})" if label else ""
    forbidden = [c for c in calls if c is not None and c.forbidden]
    if forbidden:
        ranks = _names([c.rank for c in forbidden])
        raise AssertionError(f"{forbidden[0].forbidden.replace(exercise, exercise + where, 1)} "
                             f"[on rank{'s' if len(forbidden) > 1 else ''} {ranks}]")
    stuck = [c for c in calls if c is not None and c.stuck]
    if stuck:
        group = members(calls)
        lines = []
        for c in group:
            if c.stuck:
                lines.append(f"  rank {c.rank}: blocked {c.stuck}")
            else:
                lines.append(f"  rank {c.rank}: finished its call ({len(c.sends)} send(s), "
                             f"{len(c.ops) - len(c.sends)} recv(s))")
        raise AssertionError(
            f"{exercise}{where} deadlocked: rank{'s' if len(stuck) > 1 else ''} "
            f"{_names([c.rank for c in stuck])} of {len(group)} waited {group_timeout:g} s for a "
            f"partner that never came:\n" + "\n".join(lines) + "\n"
            "A blocking dist.send returns only once its peer has posted the matching recv (and a recv "
            "once a matching send arrives): if every rank sends first, or every rank receives first, "
            "they wait in a circle. Order the calls so a partner is always posted (even ranks send "
            "first, odd ranks receive first), or post isend/irecv together and then wait.")


def _names(ranks):
    names = [str(r) for r in ranks]
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]


def members(calls):
    """The calls of the ranks that took part (a case on a sub-group leaves the others out)."""
    return [c for c in calls if c is not None and c.group_rank is not None]


def whose(value, candidates):
    """The index of the candidate tensor equal to `value` (e.g. which rank's input it is), or None."""
    if not isinstance(value, torch.Tensor):
        return None
    for index, candidate in enumerate(candidates):
        if (candidate.shape == value.shape and candidate.dtype == value.dtype
                and torch.equal(candidate.cpu(), value.cpu())):
            return index
    return None


def expect_same_bits(calls, what):
    """Every rank must end with exactly the same bits: the point of an all-reduce."""
    calls = members(calls)
    first = calls[0]
    for c in calls[1:]:
        if not torch.equal(c.after, first.after):
            diff = (c.after.double() - first.after.double()).abs().max().item()
            raise AssertionError(
                f"rank {c.rank}'s {what} differs from rank {first.rank}'s (by up to {diff:.3g}): every "
                f"rank must end with exactly the same values, or replicas drift apart. Sum in one "
                f"agreed order, or let one rank send its result to the others")


def ring_budget(numel, element_size, world_size, phases):
    """What a ring moves per rank: `phases` times N-1 steps, each one chunk of at most ⌈S/N⌉ elements.

    Returns (messages, largest message in bytes, most bytes, ideal bytes = phases·(N-1)/N·S).
    A reduce-scatter or an all-gather is one phase, an all-reduce two.
    """
    chunk = math.ceil(numel / world_size)
    steps = phases * (world_size - 1)
    return (steps, chunk * element_size, steps * chunk * element_size,
            phases * (world_size - 1) / world_size * numel * element_size)


def expect_ring_traffic(calls, numel, element_size, phases, what):
    """Check each rank's sends against a ring's: at most phases·(N-1) messages of one chunk each.

    A step is one send of a rank: rank r's k-th send is its step k. A ring all-reduce of S
    bytes on N ranks takes 2(N-1) steps of ⌈S/N⌉ bytes (up to chunk rounding): each rank
    sends 2(N-1)/N · S bytes, whatever N. Passing the whole tensor around sends (N-1)·S.
    """
    for c in members(calls):
        n = c.group_size
        steps, largest, most, ideal = ring_budget(numel, element_size, n, phases)
        sent = c.sends
        total = sum(o.nbytes for o in sent)
        chunk = math.ceil(numel / n)
        formula = (f"2(N-1)/N·S = {2 * (n - 1)}/{n}·S" if phases == 2 else f"(N-1)/N·S = {n - 1}/{n}·S")
        if total > most:
            ratio = f"{total / ideal:.1f}x the bytes of a ring {what}" if ideal else f"{total} bytes"
            raise AssertionError(
                f"rank {c.rank} sent {ratio}: {total} bytes in {len(sent)} message(s) for a tensor of "
                f"S = {numel * element_size} bytes on {n} ranks; a ring sends {formula} = {ideal:.0f} bytes "
                f"(up to chunk rounding), in {steps} steps of one chunk (⌈{numel}/{n}⌉ = {chunk} "
                f"elements) each")
        for step, o in enumerate(sent):
            if o.nbytes > largest:
                raise AssertionError(
                    f"rank {c.rank}'s step {step + 1} sent {o.nbytes} bytes to rank {world_peer(o)}, more "
                    f"than one chunk (⌈{numel}/{n}⌉ = {chunk} elements = {largest} bytes): in a ring {what} "
                    f"each of the {steps} steps sends one chunk, not the whole tensor")
        if len(sent) > steps:
            raise AssertionError(
                f"rank {c.rank} sent {len(sent)} messages: a ring {what} on {n} ranks takes {steps} steps, "
                f"one chunk each")


def chunk_bounds(length, world_size):
    """[(start, stop)] of torch.tensor_split's N chunks: the first length % N get one extra element."""
    bounds, start = [], 0
    for i in range(world_size):
        size = length // world_size + (1 if i < length % world_size else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


def _close(got, expected, atol, rtol):
    return got.shape == expected.shape and torch.allclose(got.to(expected.dtype), expected, atol=atol,
                                                          rtol=rtol, equal_nan=False)


def _elements(a, b):
    return f"element {a}" if b - a == 1 else f"elements {a}–{b - 1}"


def expect_reduce_scattered(calls, inputs, what, atol=0.0, rtol=0.0):
    """After a reduce-scatter, chunk r (of N, tensor_split) on group rank r is the sum of every
    rank's chunk r; `Call.expected` holds dist.all_reduce's result (see run_p2p's reference=)."""
    for c in members(calls):
        flat, full = c.after.reshape(-1), c.expected.reshape(-1)
        if c.after.shape != inputs[c.rank].shape:
            raise AssertionError(f"rank {c.rank}: {what} changed the tensor's shape to "
                                 f"{tuple(c.after.shape)}")
        bounds = chunk_bounds(flat.numel(), c.group_size)
        a, b = bounds[c.group_rank]
        if _close(flat[a:b], full[a:b], atol, rtol):
            continue
        hint = ""
        for j, (a2, b2) in enumerate(bounds):
            same_size = j != c.group_rank and b2 - a2 == b - a and b > a
            if same_size and _close(flat[a:b], full[a2:b2], atol, rtol):
                hint = f" -- that is the sum of chunk {j}: is a chunk index off by one?"
        for j, (a2, b2) in enumerate(bounds):
            if not hint and j != c.group_rank and b2 > a2 and _close(flat[a2:b2], full[a2:b2], atol, rtol):
                hint = (f" -- its chunk {j} holds the full sum instead: is a chunk index off by one? (rank r "
                        f"must end with chunk r)")
        if not hint and torch.equal(flat[a:b], inputs[c.rank].reshape(-1)[a:b].to(flat.device)):
            hint = " -- unchanged from this rank's input: nothing was added into it"
        raise AssertionError(
            f"rank {c.rank} (rank {c.group_rank} of {c.group_size} in its group): after {what}, its chunk "
            f"{c.group_rank} ({_elements(a, b)} of {flat.numel()}) is {describe(flat[a:b])}, expected the "
            f"sum over ranks {describe(full[a:b])}{hint}")


def expect_all_gathered(calls, inputs, full, what):
    """After an all-gather, every rank's tensor equals `full` (chunk r came from group rank r)."""
    for c in members(calls):
        flat, want = c.after.reshape(-1), full.reshape(-1).to(c.after.dtype)
        if c.after.shape != full.shape:
            raise AssertionError(f"rank {c.rank}: {what} changed the tensor's shape to "
                                 f"{tuple(c.after.shape)}")
        for j, (a, b) in enumerate(chunk_bounds(flat.numel(), c.group_size)):
            if torch.equal(flat[a:b], want[a:b]):
                continue
            before = inputs[c.rank].reshape(-1)[a:b].to(flat.device)
            hint = ""
            if before.isnan().any() and flat[a:b].isnan().any():
                hint = (" -- still NaN, like the garbage it held before the call: the chunk never arrived, "
                        "or was added to the garbage instead of copied over it")
            elif torch.equal(flat[a:b], before):
                hint = " -- it still holds what it held before the call: the chunk never arrived"
            owner = c.group_members[j] if c.group_members else j
            raise AssertionError(
                f"rank {c.rank}: after {what}, chunk {j} ({_elements(a, b)} of {flat.numel()}) is "
                f"{describe(flat[a:b])}, expected rank {owner}'s chunk {describe(want[a:b])}{hint}")


def expect_all_reduced(calls, what, atol=0.0, rtol=0.0):
    """After an all-reduce every rank's tensor equals dist.all_reduce's (`Call.expected`), in place."""
    for c in members(calls):
        if c.after.shape != c.expected.shape:
            raise AssertionError(f"rank {c.rank}: {what} changed the tensor's shape to "
                                 f"{tuple(c.after.shape)}")
        flat, full = c.after.reshape(-1), c.expected.reshape(-1)
        for j, (a, b) in enumerate(chunk_bounds(flat.numel(), c.group_size)):
            if not _close(flat[a:b], full[a:b], atol, rtol):
                raise AssertionError(
                    f"rank {c.rank}: after {what}, chunk {j} ({_elements(a, b)} of {flat.numel()}) is "
                    f"{describe(flat[a:b])}, expected {describe(full[a:b])} (dist.all_reduce's sum)")


def traffic_table(calls):
    """Rows (rank, sends, recvs, bytes sent, bytes received) to print under a demo."""
    rows = []
    for c in members(calls):
        recvs = [o for o in c.ops if o.op == "recv"]
        rows.append((c.rank, len(c.sends), len(recvs), c.sent_bytes, sum(o.nbytes for o in recvs)))
    return rows


def print_traffic(calls, title=None):
    """Print who sent how many messages and bytes, straight from the recorder."""
    if title:
        print(title)
    print(f"{'rank':>4} {'sends':>6} {'recvs':>6} {'bytes sent':>11} {'bytes received':>15}")
    for rank, sends, recvs, sent, received in traffic_table(calls):
        print(f"{rank:>4} {sends:>6} {recvs:>6} {sent:>11} {received:>15}")


def expect_from(calls, inputs, source_of, what, attr="result"):
    """Each rank r must hold inputs[source_of(r)] (as returned, or its tensor `after` the call).

    On a mismatch, say whose input the rank got instead: "rank 0 returned rank 1's tensor".
    """
    for c in members(calls):
        got, source = getattr(c, attr), source_of(c.rank)
        expected = inputs[source]
        if isinstance(got, torch.Tensor) and got.shape == expected.shape and got.dtype == expected.dtype \
                and torch.equal(got, expected.cpu()):
            continue
        verb = "returned" if attr == "result" else "holds"
        other = whose(got, inputs)
        got_text = f"rank {other}'s tensor {describe(got)}" if other is not None else describe(got)
        raise AssertionError(f"rank {c.rank}: {what} {verb} {got_text}; expected rank {source}'s: "
                             f"{describe(expected)}")


def expect_unchanged(calls, inputs, what):
    """The input must be left as it was (a function that returns its result must not also edit x)."""
    for c in members(calls):
        if not torch.equal(c.after, inputs[c.rank].cpu()):
            raise AssertionError(f"rank {c.rank}: {what} modified its input x: it is now "
                                 f"{describe(c.after)}, was {describe(inputs[c.rank])}; receive into a "
                                 f"new tensor instead")


def expect_tree_messages(calls, world, src, what):
    """Each rank but src receives exactly once; no rank sends more than ceil(log2 N) messages."""
    limit = math.ceil(math.log2(world)) if world > 1 else 0
    for c in members(calls):
        recvs = [o for o in c.ops if o.op == "recv"]
        if c.rank == src and recvs:
            raise AssertionError(f"{what}: the source rank {src} received {len(recvs)} message(s); it "
                                 f"already has the data")
        if c.rank != src and len(recvs) != 1:
            raise AssertionError(f"{what}: rank {c.rank} received {len(recvs)} messages; every rank but "
                                 f"the source needs exactly one")
        if len(c.sends) > limit:
            raise AssertionError(
                f"{what}: rank {c.rank} sent {len(c.sends)} messages; in a tree (or a ring) no rank sends "
                f"more than ⌈log2 {world}⌉ = {limit}: a source that sends a copy to every rank is the "
                f"bottleneck a broadcast algorithm avoids")


def expect_gathered(calls, inputs, what):
    """Every rank returns [x of rank 0, ..., x of rank N-1], sends at most (N-1)·|x| bytes, keeps x."""
    world = len(inputs)
    for c in members(calls):
        got = c.result
        if not isinstance(got, (list, tuple)) or len(got) != world:
            raise AssertionError(f"rank {c.rank}: {what} returned {describe(got)}; expected a list of "
                                 f"{world} tensors, entry i being rank i's x")
        for i, entry in enumerate(got):
            expected = inputs[i]
            if not (isinstance(entry, torch.Tensor) and entry.shape == expected.shape
                    and entry.dtype == expected.dtype and torch.equal(entry, expected.cpu())):
                other = whose(entry, inputs)
                text = f"rank {other}'s x {describe(entry)}" if other is not None else describe(entry)
                raise AssertionError(f"rank {c.rank}: {what}: entry {i} of the list is {text}; expected "
                                     f"rank {i}'s x {describe(expected)}")
        nbytes = inputs[c.rank].numel() * inputs[c.rank].element_size()
        if world > 1 and c.sent_bytes > (world - 1) * nbytes:
            raise AssertionError(
                f"rank {c.rank} sent {c.sent_bytes / ((world - 1) * nbytes):.1f}x the bytes an all-gather "
                f"needs ({c.sent_bytes} bytes; each rank only has to get its own {nbytes} bytes to the "
                f"{world - 1} others, directly or passed along a ring)")
    expect_unchanged(calls, inputs, what)
