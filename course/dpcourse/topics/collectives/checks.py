"""Judge a communication exercise on what each rank ended with: values, chunks, and whose data it is.

Used by the test cells and hidden checks of notebooks 03 (ring_shift, naive_all_reduce,
p2p_broadcast, p2p_all_gather) and 04 (the ring reduce-scatter, all-gather and all-reduce), on
the `RankRun` records that dpcourse.comm.p2p.run_p2p returns.

Why a module: a collective's result has a structure a plain comparison hides. A reduce-scatter is
right when chunk r (torch.tensor_split's, dpcourse.reference.splits) on rank r is the sum, an
all-gather when chunk j came from group rank j, a ring shift when rank r holds rank r-1's input.
So each check names the rank, the chunk and, when it can tell, what the rank got instead: "rank
1's tensor", "the sum of chunk 2: is a chunk index off by one?", "still NaN: the chunk never
arrived". Values are compared with the core's close-check and ratio hint (dpcourse.checks.core).
"""

import torch

from dpcourse.checks.core import describe, float_hint, is_close
from dpcourse.comm.cases import members
from dpcourse.reference.splits import chunk_bounds


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
        if is_close(flat[a:b], full[a:b], atol, rtol):
            continue
        hint = ""
        for j, (a2, b2) in enumerate(bounds):
            same_size = j != c.group_rank and b2 - a2 == b - a and b > a
            if same_size and is_close(flat[a:b], full[a2:b2], atol, rtol):
                hint = f" -- that is the sum of chunk {j}: is a chunk index off by one?"
        for j, (a2, b2) in enumerate(bounds):
            if not hint and j != c.group_rank and b2 > a2 and is_close(flat[a2:b2], full[a2:b2], atol, rtol):
                hint = (f" -- its chunk {j} holds the full sum instead: is a chunk index off by one? (rank r "
                        f"must end with chunk r)")
        if not hint and torch.equal(flat[a:b], inputs[c.rank].reshape(-1)[a:b].to(flat.device)):
            hint = " -- unchanged from this rank's input: nothing was added into it"
        hint = hint or float_hint(flat[a:b], full[a:b])
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
            if not is_close(flat[a:b], full[a:b], atol, rtol):
                raise AssertionError(
                    f"rank {c.rank}: after {what}, chunk {j} ({_elements(a, b)} of {flat.numel()}) is "
                    f"{describe(flat[a:b])}, expected {describe(full[a:b])} (dist.all_reduce's sum)"
                    f"{float_hint(flat[a:b], full[a:b])}")


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


def expect_new_tensor(calls, what, advice="return a copy, x.clone()"):
    """No rank returned its input itself (or a view of it): the caller gets a tensor of its own."""
    for c in calls:
        if c is not None and c.aliases_input:
            raise AssertionError(f"rank {c.rank}: {what} returned x itself (the same memory), not a new "
                                 f"tensor: {advice} -- the caller may change one and would change the other")


def expect_unchanged(calls, inputs, what):
    """The input must be left as it was (a function that returns its result must not also edit x)."""
    for c in members(calls):
        if not torch.equal(c.after, inputs[c.rank].cpu()):
            raise AssertionError(f"rank {c.rank}: {what} modified its input x: it is now "
                                 f"{describe(c.after)}, was {describe(inputs[c.rank])}; receive into a "
                                 f"new tensor instead")


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
