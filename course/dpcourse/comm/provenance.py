"""Where a rank's data came from: every message and every result of a communication exercise must be
made of inputs the rank really had, its own or ones that reached it in a message.

Used while grading by dpcourse.comm.calls.run_cases (notebooks 03 and 04: ring shift, naive
all-reduce, broadcast, all-gather, the ring reduce-scatter, all-gather and all-reduce).

Why: values and message counts alone cannot tell a rank that did the distributed work from one that
computed the answer by itself and sent the right number of messages of the right sizes (zeros, say).
Each rank is sent only its own input (launcher.per_rank), but test inputs can be guessed (a visible
test builds them in plain sight). So the grader's router keeps what each message carried, and this
module replays the launch, tracking what each rank *knows*: for every element position e of the
input tensors, the set of ranks whose input at e it has seen (its own from the start; a message
adds what it carried). A message must be a run of positions e .. e + k of the inputs, each element
a sum over ranks its sender knew there when it sent it; every value a rank ends with (its tensor
after the call, what it returned) must be such a sum over ranks it knew. Copies are sums over one
rank, so the rule covers broadcasts and gathers as well as reductions.

The check runs after the test cell's own checks passed (launcher.check_after_cell): it speaks only
about right answers reached the wrong way, and a wrong answer keeps its own message.
"""

import itertools

import torch

MAX_COMPARED = 2_000_000  # elements compared per message when a run starts off the chunk boundaries


def tolerance(dtype):
    """(atol, rtol) for sums of inputs of this dtype added in any order."""
    if dtype == torch.float16 or dtype == torch.bfloat16:
        return 1e-2, 1e-2
    if dtype == torch.float32:
        return 1e-5, 1e-5
    return 1e-9, 1e-9


class Knowledge:
    """Per rank and input position, the ranks whose input there a rank has seen (a bit mask)."""

    def __init__(self, inputs):
        self.ranks = [r for r, x in enumerate(inputs) if isinstance(x, torch.Tensor)]
        first = inputs[self.ranks[0]]
        self.numel, self.dtype = first.numel(), first.dtype
        self.atol, self.rtol = tolerance(first.dtype)
        self.subsets = [s for k in range(1, len(self.ranks) + 1)
                        for s in itertools.combinations(self.ranks, k)]
        flat = {r: inputs[r].detach().reshape(-1).double().cpu() for r in self.ranks}
        self.masks = torch.tensor([sum(1 << r for r in s) for s in self.subsets], dtype=torch.int64)
        self.sums = torch.stack([sum(flat[r] for r in s) for s in self.subsets])  # (subsets, numel)
        self.known = {r: torch.full((self.numel,), 1 << r, dtype=torch.int64) for r in self.ranks}

    def explain(self, rank, values):
        """How the flat tensor `values` is made of inputs `rank` had: for some run of positions
        offset .. offset + k, element i is a sum over ranks the rank knew at offset + i (each element
        its own set: a message may carry chunks of different ranks). Returns (the ranks' masks per
        valid offset and element, a (offsets, k) tensor, and the offsets), or None if it is not.
        A short message may fit in several places by coincidence: all of them count."""
        values = values.detach().reshape(-1).double().cpu()
        k = values.numel()
        if k == 0:
            return torch.zeros(0, 0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
        if k > self.numel or rank not in self.known:
            return None
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
                return learned, offsets[fits]
        return None

    def _offsets(self, k):
        """Where a run of k elements may start: first where chunks of a split into n parts start
        (torch.tensor_split's, n up to 8, and multiples of k), then anywhere (if small enough)."""
        aligned = {i * k for i in range(self.numel // k)} | {self.numel - k}
        for n in range(1, 9):
            aligned |= {i * (self.numel // n) + min(i, self.numel % n) for i in range(n)}
        aligned = torch.tensor(sorted(a for a in aligned if 0 <= a <= self.numel - k))
        yield aligned
        if len(self.subsets) * (self.numel - k + 1) * k <= MAX_COMPARED:
            yield torch.arange(self.numel - k + 1)

    def learn(self, rank, explained, k):
        """`rank` received a message `explained` (what `explain` returned for its sender)."""
        learned, offsets = explained
        if rank not in self.known or not k:
            return
        for row, offset in zip(learned, offsets.tolist(), strict=True):
            self.known[rank][offset:offset + k] |= row

    def values_known(self, rank, value):
        """The first position (index into the flat tensor) of `value` (same shape as the inputs) that
        is not a sum over ranks `rank` knew there, with the value; None if every element is."""
        if not isinstance(value, torch.Tensor) or value.numel() != self.numel or rank not in self.known:
            return None
        flat = value.detach().reshape(-1).double().cpu()
        close = (self.sums - flat).abs() <= self.atol + self.rtol * self.sums.abs()  # (subsets, numel)
        allowed = (self.known[rank][None, :] & self.masks[:, None]) == self.masks[:, None]
        explained = (close & allowed).any(dim=0)
        if bool(explained.all()):
            return None
        return int((~explained).nonzero()[0])


def _names(mask):
    ranks = [r for r in range(mask.bit_length()) if mask >> r & 1]
    return ", ".join(map(str, ranks))


def expect_derived(calls, inputs, flow, what):
    """Raise an AssertionError unless every message of a launch and every value its ranks ended with
    is a sum of inputs the rank had (see the module docstring). `calls`: one Call per world rank
    (comm.calls); `inputs`: the case's input per world rank; `flow`: the router's message log
    (launcher.observed_messages: ("post" or "deliver", src, dst, message id, tensor))."""
    if flow is None or not any(isinstance(x, torch.Tensor) and x.numel() for x in inputs):
        return
    knowledge = Knowledge(inputs)
    explained = {}
    for kind, src, dst, message, tensor in flow:
        if kind == "post":  # what the sender knew when its message reached the router
            found = knowledge.explain(src, tensor)
            if found is None:
                raise AssertionError(
                    f"rank {src}: {what} sent rank {dst} a message ({tensor.numel()} elements) that is "
                    f"not made of data rank {src} had when it sent it (its own input and what it had "
                    f"received): every value a rank passes on must come from its input or from "
                    f"messages, not be worked out or made up on the side")
            explained[message] = found
        elif message in explained:
            knowledge.learn(dst, explained[message], tensor.numel())
    for call in calls:
        if call is None or call.group_rank is None:
            continue
        finals = [("its tensor after the call", call.after)]
        if isinstance(call.result, torch.Tensor):
            finals.append(("what it returned", call.result))
        elif isinstance(call.result, (list, tuple)):
            finals += [(f"entry {i} of what it returned", v) for i, v in enumerate(call.result)]
        for where, value in finals:
            position = knowledge.values_known(call.rank, value)
            if position is not None:
                raise AssertionError(
                    f"rank {call.rank}: {what}: {where} holds, at element {position}, a value that rank "
                    f"{call.rank} could not have from its own input and the messages it received (it "
                    f"knew the inputs of ranks {_names(int(knowledge.known[call.rank][position]))} "
                    f"there): the result must be built from what arrives in messages")
