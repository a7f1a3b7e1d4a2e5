"""Who sent how much: the traffic checks of the communication exercises, and the tables demos print.

A ring is defined by its traffic: 2(N-1) steps of one chunk each for an all-reduce, so each
rank sends 2(N-1)/N · S bytes whatever N. `expect_ring_traffic` holds each rank to exactly
that (a rank that sends too much is not a ring, a rank that sends too little left its data
out); `print_traffic` shows the same numbers under a demo. The records come from the in-rank
recorder in a notebook and from the grader's router while grading (dpcourse.comm.cases).
Used by notebooks 03 and 04.
"""

import math

from dpcourse.comm.cases import members
from dpcourse.comm.volume import ring_traffic
from dpcourse.reference.splits import ceil_div
from dpcourse.viz.tables import print_table


def ring_budget(numel, element_size, world_size, phases):
    """What a ring moves per rank: `phases` times N-1 steps, each one chunk of at most ⌈S/N⌉ elements.

    Returns (messages, largest message in bytes, most bytes, ideal bytes = phases·(N-1)/N·S).
    A reduce-scatter or an all-gather is one phase, an all-reduce two.
    """
    chunk = ceil_div(numel, world_size)
    steps, ideal = ring_traffic(numel * element_size, world_size, phases)
    return steps, chunk * element_size, steps * chunk * element_size, ideal


def expect_ring_traffic(calls, numel, element_size, phases, what):
    """Check each rank's sends against a ring's: exactly phases·(N-1) messages of one chunk each.

    A step is one send of a rank: rank r's k-th send is its step k. A ring all-reduce of S
    bytes on N ranks takes 2(N-1) steps of ⌈S/N⌉ bytes (up to chunk rounding): each rank
    sends 2(N-1)/N · S bytes, whatever N. Passing the whole tensor around sends (N-1)·S.
    """
    for c in members(calls):
        n = c.group_size
        steps, largest, most, ideal = ring_budget(numel, element_size, n, phases)
        sent = c.sends
        total = sum(o.nbytes for o in sent)
        chunk = ceil_div(numel, n)
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
                    f"rank {c.rank}'s step {step + 1} sent {o.nbytes} bytes to rank {o.world_peer}, more "
                    f"than one chunk (⌈{numel}/{n}⌉ = {chunk} elements = {largest} bytes): in a ring {what} "
                    f"each of the {steps} steps sends one chunk, not the whole tensor")
        if len(sent) > steps:
            raise AssertionError(
                f"rank {c.rank} sent {len(sent)} messages: a ring {what} on {n} ranks takes {steps} steps, "
                f"one chunk each")
        if numel >= n and len(sent) < steps:  # every chunk holds data: every step must send it on
            raise AssertionError(
                f"rank {c.rank} sent {len(sent)} message(s): a ring {what} on {n} ranks takes exactly "
                f"{steps} steps, one chunk each; a rank that sends less keeps its data from the others")
        least = phases * (n - 1) * (numel // n) * element_size
        if total < least:
            raise AssertionError(
                f"rank {c.rank} sent only {total} bytes: in a ring {what} each rank passes on a chunk at "
                f"each of its {steps} steps, at least {least} bytes for S = {numel * element_size} bytes "
                f"on {n} ranks")


def traffic_table(calls):
    """Rows (rank, sends, recvs, bytes sent, bytes received) to print under a demo."""
    rows = []
    for c in members(calls):
        recvs = [o for o in c.ops if o.op == "recv"]
        rows.append((c.rank, len(c.sends), len(recvs), c.sent_bytes, sum(o.nbytes for o in recvs)))
    return rows


def print_traffic(calls, title=None):
    """Print who sent how many messages and bytes, straight from the recorder."""
    print_table(traffic_table(calls), [("rank", 4), ("sends", 6), ("recvs", 6), ("bytes sent", 11),
                                       ("bytes received", 15)], title)


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
