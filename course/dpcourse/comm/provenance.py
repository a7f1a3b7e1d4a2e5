"""Where a rank's data came from: every message, every part a rank puts into a collective and every value
it ends with must be made of data the rank really had -- its own inputs, or what reached it.

    Case(parts, replay=Sums(inputs))                  # sums and copies at the same positions (03, 04, 08, 12)
    Case(parts, replay=Copies(inputs, derived=...))   # copies anywhere, and values a rank may compute

Used while grading by every chapter whose values could be computed without the messages (test inputs
can be guessed: a visible test builds them in plain sight, seeds are small numbers): notebooks 03 and 04
(ring shift, naive all-reduce, broadcast, all-gather, the ring reduce-scatter, all-gather and
all-reduce), 08 (f, g and the gather of tensor parallelism), 11 (the compressed all-gathers of top-k)
and 12 (ring and Ulysses attention, the sequence-parallel all-gather and reduce-scatter). The case
runner (dpcourse.comm.cases) runs a case's replay on the router's record of that case, once the test
cell's own checks passed (launcher.check_after_cell): it speaks only about right answers reached the
wrong way, and a wrong answer keeps its own message.

Why: values and message counts alone cannot tell a rank that did the distributed work from one that
computed the answer by itself and sent the right number of messages of the right sizes (zeros, say).
Each rank is sent only its own inputs (comm.cases), so the grader's router keeps what each message and
each collective carried, and a replay tracks what each rank *knows*:

* `Sums` -- for every element position e of the inputs (each rank's inputs flattened end to end, the
  same sizes on every rank), the set of ranks whose input at e a rank has seen (its own from the
  start; a message or a collective adds what it carried). A message must be a run of positions e ..
  e + k of the inputs, each element a sum over ranks its sender knew there; a final value of the
  inputs' layout must be such a sum at every position. Copies are sums over one rank, so the rule
  covers broadcasts and gathers as well as reductions.
* `Copies` -- every element a rank sends must be a copy of an element it knows (any position of
  anyone's inputs), or of a value it may compute: `derived` lists, per rank, values (attention's
  output on its heads) and the inputs it must know first (those heads' queries, keys and values of
  every position). Integer tensors (indices) are not data and are not checked.

Both compare numbers with the course's one tolerance table (dpcourse.checks.core.TOLERANCES).
"""

import itertools

import torch

from dpcourse.checks.core import TOLERANCES

MAX_COMPARED = 2_000_000  # elements compared per message when a run starts off the chunk boundaries
REDUCTIONS = {"all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor"}


def tolerance(dtype):
    """(atol, rtol) for sums of inputs of this dtype added in any order (checks.core.TOLERANCES)."""
    if dtype in (torch.float16, torch.bfloat16):
        return TOLERANCES["half sums in any order"]
    if dtype == torch.float32:
        return TOLERANCES["float32 sums in any order"]
    return TOLERANCES["float64 sums in any order"]


def _flat(value):
    """A rank's inputs (a tensor, or a list of tensors) as one flat float64 vector; None for none."""
    if value is None:
        return None
    tensors = [value] if isinstance(value, torch.Tensor) else list(value)
    return torch.cat([t.detach().reshape(-1).double().cpu() for t in tensors]) if tensors else None


def _sizes(value):
    tensors = [value] if isinstance(value, torch.Tensor) else list(value)
    return [t.numel() for t in tensors]


def _dtype(value):
    return value.dtype if isinstance(value, torch.Tensor) else value[0].dtype


def deliveries(op, members, payloads):
    """Who receives which part of a collective: [(receiver, sender, index into the sender's payload)].
    payloads: {member: its list of input tensors}, as the router keeps them (CommOp.payload). The
    collectives whose root the record does not name (broadcast, reduce, gather, scatter) deliver every
    part to every member: the replay is lenient there."""
    n = len(members)
    out = []
    for receiver in members:
        r = members.index(receiver)
        for sender in members:
            count = len(payloads.get(sender, ()))
            if op in ("all_to_all", "all_to_all_single", "reduce_scatter", "reduce_scatter_tensor"):
                out += [(receiver, sender, i) for i in range(count) if i % n == r]
            else:
                out += [(receiver, sender, i) for i in range(count)]
    return out


def _value_tensors(value):
    """The tensors in a final value: a tensor, or the entries of a list."""
    if isinstance(value, torch.Tensor):
        return [("", value)]
    if isinstance(value, (list, tuple)):
        return [(f"entry {i} of ", v) for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
    return []


class Replay:
    """What `Sums` and `Copies` share: the walk over a case's messages and collectives (the events of
    comm.cases.case_events) and the final values; a model says what is known and what may be sent."""

    finals = ()
    only = None  # which events are replayed: only(event) -> bool (None: all of them)

    def check(self, runs, events, what):
        """Raise an AssertionError unless every message, every part put into a collective and every
        final value named in `finals` is made of data its rank had."""
        if not self.ready():
            return
        explained = {}
        for event in events:
            if self.only is not None and not self.only(event):
                continue
            if event[0] == "post":
                _, src, dst, message, tensor = event
                found = self.explain(src, tensor)
                if found is None:
                    raise AssertionError(
                        f"rank {src}: {what} sent rank {dst} a message ({tensor.numel()} elements) that is "
                        f"not made of data rank {src} had when it sent it (its own input and what it had "
                        f"received): every value a rank passes on must come from its input or from "
                        f"messages, not be worked out or made up on the side")
                explained[message] = found
            elif event[0] == "deliver":
                _, _, dst, message, tensor = event
                if message in explained:
                    self.learn(dst, explained[message])
            else:
                self._collective(event[1], event[2], what)
        self._finals(runs, what)

    def _collective(self, group, ops, what):
        members = list(group) if group else sorted(ops)
        payloads, found = {}, {}
        for rank, o in sorted(ops.items()):
            payloads[rank] = list(o.payload or ())
            for i, tensor in enumerate(payloads[rank]):
                if not self.is_data(tensor):
                    continue
                explained = self.explain(rank, tensor)
                if explained is None:
                    raise AssertionError(
                        f"rank {rank}: {what} put into its {o.op} a tensor ({tensor.numel()} elements) that "
                        f"is not made of data rank {rank} had then (its own input and what had reached it): "
                        f"every value a rank passes on must come from its input or from what it received, "
                        f"not be worked out or made up on the side")
                found[(rank, i)] = explained
        op = next(iter(ops.values())).op
        for receiver, sender, i in deliveries(op, members, payloads):
            if (sender, i) in found:
                self.learn(receiver, found[(sender, i)])

    def _finals(self, runs, what):
        for run in runs:
            if run is None or run.group is None:
                continue
            for name in self.finals:
                for entry, value in _value_tensors(run.values.get(name)):
                    position = self.unknown_at(run.rank, value)
                    if position is not None:
                        raise AssertionError(
                            f"rank {run.rank}: {what}: {entry}{name.replace('_', ' ')} holds, at element "
                            f"{position}, a value that rank {run.rank} could not have from its own input and "
                            f"what reached it{self.known_there(run.rank, position)}: the result must be "
                            f"built from what arrives in messages")

    def is_data(self, tensor):
        return isinstance(tensor, torch.Tensor) and tensor.numel() > 0

    def known_there(self, rank, position):
        return ""


class Sums(Replay):
    """Values are sums over ranks of the inputs at the same positions (see the module docstring).

    inputs: per world rank its input (a tensor, or a list of tensors taken end to end; the same sizes
    on every rank, else nothing is replayed), None for a rank without. finals: names of the values
    (RankRun.values) that must also be such sums: "after" (the tensor an in-place function changed),
    "result", "output", ...
    """

    def __init__(self, inputs, finals=("after", "result")):
        self.ranks = [r for r, x in enumerate(inputs) if x is not None]
        self.finals = tuple(finals)
        if not self.ranks:
            return
        first = inputs[self.ranks[0]]
        self.sizes = _sizes(first)
        self.numel = sum(self.sizes)
        self.atol, self.rtol = tolerance(_dtype(first))
        flat = {r: _flat(inputs[r]) for r in self.ranks}
        if any(flat[r].numel() != self.numel for r in self.ranks):  # positions do not line up: no replay
            self.ranks = []
            return
        self.subsets = [s for k in range(1, len(self.ranks) + 1)
                        for s in itertools.combinations(self.ranks, k)]
        self.masks = torch.tensor([sum(1 << r for r in s) for s in self.subsets], dtype=torch.int64)
        self.sums = torch.stack([sum(flat[r] for r in s) for s in self.subsets])  # (subsets, numel)
        self.known = {r: torch.full((self.numel,), 1 << r, dtype=torch.int64) for r in self.ranks}

    def ready(self):
        return bool(self.ranks) and self.numel > 0

    def explain(self, rank, values):
        """How the flat tensor `values` is made of inputs `rank` had: a run of positions offset .. offset + k,
        element i a sum over ranks the rank knew at offset + i (each element its own set: a message may
        carry chunks of different ranks). Returns [(masks learned per valid offset and element, the
        offsets, k)], or None if it is not. A short message may fit in several places by coincidence: all
        of them count."""
        values = values.detach().reshape(-1).double().cpu()
        k = values.numel()
        if k == 0:
            return []
        if k > self.numel or rank not in self.known:
            return None
        run = self._run(rank, values)
        return None if run is None else [run]

    def _run(self, rank, values):
        """(masks per offset and element, offsets, k) for a run of positions, or None."""
        k = values.numel()
        for offsets in self._offsets(k):
            positions = offsets[:, None] + torch.arange(k)  # (offsets, k)
            windows = self.sums[:, positions]  # (subsets, offsets, k)
            close = (windows - values).abs() <= self.atol + self.rtol * windows.abs()
            known = self.known[rank][positions]  # (offsets, k)
            ok = close & ((known[None] & self.masks[:, None, None]) == self.masks[:, None, None])
            fits = ok.any(dim=0).all(dim=1)  # offsets where every element is made of known inputs
            if fits.any():
                ok = ok[:, fits]
                learned = torch.zeros(ok.shape[1:], dtype=torch.int64)
                for s_index in ok.flatten(1).any(dim=1).nonzero().flatten().tolist():
                    learned |= torch.where(ok[s_index], self.masks[s_index], 0)
                return learned, offsets[fits], k
        return None

    def _offsets(self, k):
        """Where a run of k elements may start: first where chunks of a split into n parts start (each
        input's torch.tensor_split, n up to 8, and multiples of k), then anywhere (if small enough)."""
        aligned = {self.numel - k}
        start = 0
        for size in self.sizes:
            aligned |= {start + i * k for i in range(size // k + 1)} | {start + size - k}
            for n in range(1, 9):
                aligned |= {start + i * (size // n) + min(i, size % n) for i in range(n)}
            start += size
        aligned = torch.tensor(sorted(a for a in aligned if 0 <= a <= self.numel - k))
        yield aligned
        if len(self.subsets) * (self.numel - k + 1) * k <= MAX_COMPARED:
            yield torch.arange(self.numel - k + 1)

    def learn(self, rank, explained):
        """`rank` received a message (or a part of a collective) `explained` for its sender."""
        if rank not in self.known:
            return
        for learned, offsets, k in explained:
            for row, offset in zip(learned, offsets.tolist(), strict=True):
                self.known[rank][offset:offset + k] |= row

    def unknown_at(self, rank, value):
        """The first element of `value` that is not made of data `rank` knew, or None if every one is."""
        if not isinstance(value, torch.Tensor) or not value.numel() or rank not in self.known:
            return None
        if value.numel() == self.numel:  # the same layout as the inputs: element e at position e
            flat = value.detach().reshape(-1).double().cpu()
            close = (self.sums - flat).abs() <= self.atol + self.rtol * self.sums.abs()  # (subsets, numel)
            allowed = (self.known[rank][None, :] & self.masks[:, None]) == self.masks[:, None]
            explained = (close & allowed).any(dim=0)
            return None if bool(explained.all()) else int((~explained).nonzero()[0])
        return None  # another layout (a piece, a gathered whole): its messages were checked on the way

    def known_there(self, rank, position):
        if position >= self.numel:
            return ""
        mask = int(self.known[rank][position])
        ranks = ", ".join(str(r) for r in range(mask.bit_length()) if mask >> r & 1)
        return f" (it knew the inputs of ranks {ranks} there)"


class Copies(Replay):
    """Values are copies of data a rank knows, from anywhere in anyone's inputs (see the module docstring).

    inputs: per world rank its inputs (a tensor or a list of tensors), None for a rank without.
    derived: per world rank a list of (needs, values): the rank may hold `values` (a tensor computed by
    the check, e.g. attention's output on the heads it owns) once it knows every input element `needs`
    names ({input rank: a boolean mask over that rank's flat inputs}, or None: from the start).
    finals: names of the values (RankRun.values) every element of which must be known at the end.
    slack: elements of a message that may be none of these (the zeros that pad a shard to ⌈S/N⌉).
    only: only(event) -> bool, the events replayed (see comm.cases.case_events); None: all.
    """

    def __init__(self, inputs, derived=None, finals=(), slack=0, only=None):
        self.finals, self.slack, self.only = tuple(finals), slack, only
        present = [x for x in inputs if x is not None]
        self.dtype = _dtype(present[0]) if present else torch.float64
        self.atol, self.rtol = TOLERANCES.get(self.dtype, TOLERANCES[torch.float64])
        pieces, owners, offsets, start = [], [], {}, 0
        for r, x in enumerate(inputs):
            flat = _flat(x)
            if flat is None:
                continue
            offsets[r] = start
            pieces.append(flat)
            owners.append(torch.full((flat.numel(),), r, dtype=torch.int64))
            start += flat.numel()
        self.unlocks = []  # [(rank, needs as an id mask, first atom id, last atom id)]
        for r, entries in enumerate(derived or []):
            for needs, values in entries or ():
                flat = values.detach().reshape(-1).double().cpu()
                need = None
                if needs is not None:
                    need = torch.zeros(start, dtype=torch.bool)
                    for owner, mask in needs.items():
                        need[offsets[owner]:offsets[owner] + mask.numel()] |= mask.reshape(-1).cpu()
                self.unlocks.append((r, need, sum(p.numel() for p in pieces), flat.numel()))
                pieces.append(flat)
                owners.append(torch.full((flat.numel(),), -1, dtype=torch.int64))
        self.values = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.float64)
        total = self.values.numel()
        self.order = torch.argsort(self.values)
        self.sorted = self.values[self.order]
        self.position = torch.empty(total, dtype=torch.int64)
        self.position[self.order] = torch.arange(total)
        owner = torch.cat(owners) if owners else torch.zeros(0, dtype=torch.int64)
        self.known = {r: (owner == r)[self.order] for r in range(len(inputs))}  # by sorted position
        padding = torch.zeros(total - start, dtype=torch.bool)
        self.unlocks = [(r, None if need is None else torch.cat([need, padding])[self.order], first, count)
                        for r, need, first, count in self.unlocks]
        for r, need, first, count in self.unlocks:
            if need is None:
                self.known[r][self.position[first:first + count]] = True

    def ready(self):
        return self.values.numel() > 0

    def is_data(self, tensor):
        return super().is_data(tensor) and tensor.is_floating_point()

    def _unlock(self, rank):
        for r, need, first, count in self.unlocks:
            if r == rank and need is not None and bool((self.known[rank] | ~need).all()):
                self.known[rank][self.position[first:first + count]] = True

    def _ranges(self, values):
        values = values.detach().reshape(-1).double().cpu()
        tol = self.atol + self.rtol * values.abs()
        return (torch.searchsorted(self.sorted, values - tol),
                torch.searchsorted(self.sorted, values + tol, right=True))

    def explain(self, rank, values):
        """The ranges of known data each element copies, or None if some element copies nothing known."""
        if not values.is_floating_point():  # indices, counts: not data
            return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
        self._unlock(rank)
        lo, hi = self._ranges(values)
        known = torch.cat([torch.zeros(1, dtype=torch.int64), self.known[rank].long().cumsum(0)])
        found = (known[hi] - known[lo]) > 0
        if int((~found).sum()) > min(self.slack, values.numel() - 1):
            return None
        return lo[found], hi[found]

    def learn(self, rank, explained):
        lo, hi = explained
        if not len(lo):
            return
        steps = torch.zeros(self.values.numel() + 1, dtype=torch.int64)
        steps.index_add_(0, lo, torch.ones_like(lo))
        steps.index_add_(0, hi, -torch.ones_like(hi))
        self.known[rank] |= steps.cumsum(0)[:-1] > 0

    def unknown_at(self, rank, value):
        if not isinstance(value, torch.Tensor) or not value.numel() or not value.is_floating_point():
            return None
        self._unlock(rank)
        lo, hi = self._ranges(value)
        known = torch.cat([torch.zeros(1, dtype=torch.int64), self.known[rank].long().cumsum(0)])
        missing = ((known[hi] - known[lo]) == 0).nonzero()
        return int(missing[0]) if len(missing) else None
