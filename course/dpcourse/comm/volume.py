"""How many bytes a rank sends for each recorded call, counted as the ring algorithms send them.

    ops = recorded(...)[1]                     # CommOps of one rank (comm.recorder)
    bytes_sent(ops)                             # what this rank put on the network
    volume_by_op(ops)                           # {"all_gather": ..., "reduce_scatter": ...}

Why a module: the recorder sees a collective as one call with its tensors, not the messages
the library sends for it. To compare designs by their traffic (DDP's all-reduce against
ZeRO's reduce-scatter and all-gathers, notebook 10), each call is converted into the bytes
one rank sends when the collective runs as a bandwidth-optimal ring (notebook 04; NCCL's
ring algorithm), with S the bytes of the whole vector and N the group size:

    all_reduce      2(N-1)/N · S      the recorder sees the whole vector S
    reduce_scatter   (N-1)/N · S      the recorder sees the whole input S
    all_gather       (N-1)/N · S      S = the whole output; the recorder sees this rank's chunk S/N
    broadcast        (N-1)/N · S      the average over ranks of a pipelined ring (the last rank sends nothing)
    reduce           (N-1)/N · S      the same ring, towards the destination
    all_to_all       (N-1)/N · S      S = its whole input; it keeps its own 1/N
    send                 S            its own bytes; a recv sends nothing

This is the ZeRO paper's count (Rajbhandari et al., 2020, section 7), which rounds (N-1)/N
to 1: "communication volume" Ψ for a reduce-scatter or an all-gather, 2Ψ for an all-reduce.

`ring_traffic` is the course's one statement of a ring's cost, `all_to_all_traffic` of an all-to-all's:
every other module that prices one (the cost model of notebooks 04, 06 and 09: `messages_and_bytes`,
`predicted_time` here; the traffic checks; the planners of 09 and 12) calls them.
"""

import math
from collections import defaultdict

ALGORITHMS = ("naive", "tree", "ring")


def ring_traffic(nbytes, world_size, phases=2):
    """(steps, bytes) one rank sends in a bandwidth-optimal ring over `world_size` ranks.

    A phase is N-1 steps of one chunk, S/N bytes: a reduce-scatter or an all-gather is one phase,
    an all-reduce two (reduce-scatter, then all-gather), so an all-reduce of S bytes costs each
    rank 2(N-1) steps and 2(N-1)/N · S bytes, whatever N (notebook 04). One rank: nothing.
    """
    n = world_size
    if n <= 1:
        return 0, 0.0
    return phases * (n - 1), phases * (n - 1) / n * nbytes


def all_to_all_traffic(nbytes, world_size, calls=1):
    """(messages, bytes) one rank sends in `calls` all-to-alls of `nbytes` of input in all: a rank keeps
    its own 1/N and sends the rest, one message to each other rank per call: calls·(N-1) messages,
    (N-1)/N · S bytes (Ulysses' sequence <-> heads exchanges, experts' token dispatch: notebook 12)."""
    n = world_size
    if n <= 1:
        return 0, 0.0
    return calls * (n - 1), (n - 1) / n * nbytes


def messages_and_bytes(algorithm, nbytes, world_size):
    """(messages sent, bytes sent) by the busiest rank of an all-reduce of nbytes on world_size ranks."""
    n = world_size
    if n == 1:
        return 0, 0
    if algorithm == "naive":
        return n - 1, (n - 1) * nbytes  # the root sends the sum back to every other rank
    if algorithm == "tree":
        depth = math.ceil(math.log2(n))
        return 2 * depth, 2 * depth * nbytes  # worst case: one send up, the root's depth sends down
    if algorithm == "ring":
        return ring_traffic(nbytes, n)
    raise ValueError(f"unknown algorithm {algorithm!r}: use one of {ALGORITHMS}")


def predicted_time(algorithm, nbytes, world_size, alpha, beta):
    """Seconds the alpha-beta model predicts for an all-reduce (see the module docstring)."""
    n = world_size
    if n == 1:
        return 0.0
    if algorithm == "naive":
        return 2 * (n - 1) * (alpha + nbytes / beta)
    if algorithm == "tree":
        return 2 * math.ceil(math.log2(n)) * (alpha + nbytes / beta)
    if algorithm == "ring":
        steps, sent = ring_traffic(nbytes, n)
        return steps * alpha + sent / beta
    raise ValueError(f"unknown algorithm {algorithm!r}: use one of {ALGORITHMS}")


# bytes a rank sends for one recorded call of `nbytes` (what the recorder saw) in a group of n ranks
_RING = {
    "all_reduce": lambda nbytes, n: ring_traffic(nbytes, n)[1],
    "all_gather": lambda nbytes, n: ring_traffic(nbytes * n, n, phases=1)[1],  # recorded: this rank's chunk
    "all_gather_into_tensor": lambda nbytes, n: ring_traffic(nbytes * n, n, phases=1)[1],
    "reduce_scatter": lambda nbytes, n: ring_traffic(nbytes, n, phases=1)[1],  # recorded: the whole input
    "reduce_scatter_tensor": lambda nbytes, n: ring_traffic(nbytes, n, phases=1)[1],
    "broadcast": lambda nbytes, n: ring_traffic(nbytes, n, phases=1)[1],
    "reduce": lambda nbytes, n: ring_traffic(nbytes, n, phases=1)[1],
    "all_to_all": lambda nbytes, n: all_to_all_traffic(nbytes, n)[1],  # recorded: the whole input
    "all_to_all_single": lambda nbytes, n: all_to_all_traffic(nbytes, n)[1],
    "send": lambda nbytes, n: nbytes,
}
_NOTHING = {"recv", "recv_any_source", "barrier", "monitored_barrier"}


def ring_bytes(op, world_size=None):
    """Bytes this rank sends for one recorded call (a CommOp), as a ring would send them.

    The group size comes from the record (`op.group`), else from `world_size`.
    """
    if op.op in _NOTHING:
        return 0.0
    if op.op not in _RING:
        raise ValueError(f"no ring traffic model for {op.op!r} (known: {', '.join(sorted(_RING))})")
    n = len(op.group) if op.group else world_size
    if n is None:
        raise ValueError(f"the record of {op.op} names no group: pass world_size")
    return float(_RING[op.op](op.nbytes, n)) if n > 1 or op.op == "send" else 0.0


def bytes_sent(ops, world_size=None):
    """Total bytes one rank sends for a list of recorded calls (see ring_bytes)."""
    return sum(ring_bytes(op, world_size) for op in ops)


def volume_by_op(ops, world_size=None):
    """{op name: bytes sent} for a list of recorded calls, in the order the ops first appear."""
    totals = defaultdict(float)
    for op in ops:
        totals[op.op] += ring_bytes(op, world_size)
    return dict(totals)
