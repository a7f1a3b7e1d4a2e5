"""Verdicts for notebook 12's sequence- and context-parallel test cells, against one-process float64 math.

    expect_operator(runs, case, gather_semantics(case, 2), "gather_sequence")   # (tensor.checks)
    expect_block(runs, case, "SequenceParallelMLP")
    expect_ring(runs, case, "ring_attention")                 # messages, then values
    expect_ulysses(runs, case, "ulysses_attention")
    expect_balanced(runs, case, "ring_attention")             # work per rank, counted
    expect_flat_memory(small, large, "ring_attention")        # peak memory at 2 and at 4 ranks

Why a module: each exercise is right when every rank's values are its piece of what one
process computes on the whole sequence (the MLP block, or attention written out in float64),
when each direction issues exactly the communication the design calls for, and when the
measured claims hold (memory of the LayerNorm region 1/t; no rank holding every K/V block;
the same work on every rank of a balanced causal split). Known mistakes have signatures --
a ring merged without rescaling, a causal mask on local instead of global positions, the
blocks' origins off by one step -- and the messages name them, with the rank, step and block.
Nothing here comes from the ranks but what the learner's code produced (docs/authoring.md).
"""

import math

import torch

from dpcourse.checks.tensors import (
    ATOL,
    RTOL,
    close,
    expect_collectives,
    expect_copies,
    expect_parameters_held,
    expect_tensor,
)
from dpcourse.comm.cases import members_of
from dpcourse.comm.volume import bytes_sent, ring_traffic
from dpcourse.topics.sequence.measure import LayerNormBytes
from dpcourse.topics.sequence.models import (
    attention,
    contiguous_positions,
    head_tail_positions,
    mlp_block,
    visible_pairs,
)
from dpcourse.topics.sequence.runs import case_positions, case_tensors, piece

F64 = 8
GATHER = ("all_gather", "all_gather_into_tensor")
REDUCE_SCATTER = ("reduce_scatter", "reduce_scatter_tensor")
ALL_TO_ALL = ("all_to_all_single", "all_to_all")
BLOCK = {"norm.weight": "replicated", "norm.bias": "replicated", "fc1.weight": "column", "fc1.bias": "column",
         "fc2.weight": "row", "fc2.bias": "replicated"}
PARTIAL = ("norm.weight", "norm.bias", "fc2.bias")  # replicated, used on this rank's tokens only


def _sum(tensors, members):
    return sum(tensors[m].double() for m in members)


def _world_sum(tensors, index, n):
    """The world's sum, this rank's piece of it: a known wrong answer, when every rank's shapes agree."""
    if len({tuple(t.shape) for t in tensors}) > 1:
        return []
    return [(piece(_sum(tensors, range(len(tensors))), index, n), "summed over every rank of the world, not "
                                                                  "the "
                                                                   "group")]


# --------------------------------------------------------------------------- 1-2. the two operators

def gather_semantics(case, world_size):
    """gather_sequence: forward, the group's pieces one after the other along dim 0 (group-rank
    order); backward, the sum over the group of the output gradients, this rank's piece of it."""
    xs, dys = case["inputs"], case["grads"]
    out = {"outputs": [], "grads": [], "forward": [], "backward": [], "wrong_outputs": {}, "wrong_grads": {},
           "input_in_place": "all-gather into a new tensor (torch.empty(n * rows, ..., dtype=x.dtype)), "
                             "never into x or a view of it: the caller still needs x",
           "grad_in_place": "reduce-scatter into a new tensor (torch.empty(rows // n, ...)), not into the "
                            "gradient or a piece of it -- the tensor autograd hands to backward may be the "
                            "caller's own"}
    for rank in range(world_size):
        group = members_of(case.get("groups"), rank, world_size)
        index, n = group.index(rank), len(group)
        out["outputs"].append(torch.cat([xs[m].double() for m in group]))
        total = _sum(dys, group)
        out["grads"].append(piece(total, index, n))
        out["forward"].append([(GATHER, xs[rank].numel() * F64)])
        out["backward"].append([(REDUCE_SCATTER, dys[rank].numel() * F64)])
        out["wrong_outputs"][rank] = [
            (torch.cat([xs[m].double() for m in reversed(group)]),
             "the pieces are in the wrong order: piece i comes from group rank i")]
        out["wrong_grads"][rank] = [
            (piece(dys[rank].double(), index, n),
             "this rank's own piece of its own gradient: every rank's gradient of the gathered sequence is "
             "different (each feeds its own slice of the weights), so they are summed -- a reduce-scatter"),
            (piece(total, index, n) / n, "averaged: backward sums the ranks' gradients, it does not divide "
                                         "by N"),
            *_world_sum(dys, index, n)]
    return out


def reduce_scatter_semantics(case, world_size):
    """reduce_scatter_sequence: forward, this rank's piece (dim 0) of the sum over the group;
    backward, the group's gradient pieces one after the other (an all-gather)."""
    xs, dys = case["inputs"], case["grads"]
    out = {"outputs": [], "grads": [], "forward": [], "backward": [], "wrong_outputs": {}, "wrong_grads": {},
           "input_in_place": "reduce-scatter into a new tensor (torch.empty(rows // n, ..., dtype=x.dtype)), "
                             "not into x or a piece of it (x.chunk(n)[r] is a view of x): the caller still "
                             "needs x",
           "grad_in_place": "all-gather into a new tensor (torch.empty(n * rows, ...)), never into the "
                            "gradient -- the tensor autograd hands to backward may be the caller's own"}
    for rank in range(world_size):
        group = members_of(case.get("groups"), rank, world_size)
        index, n = group.index(rank), len(group)
        total = _sum(xs, group)
        out["outputs"].append(piece(total, index, n))
        out["grads"].append(torch.cat([dys[m].double() for m in group]))
        out["forward"].append([(REDUCE_SCATTER, xs[rank].numel() * F64)])
        out["backward"].append([(GATHER, dys[rank].numel() * F64)])
        out["wrong_outputs"][rank] = [
            (piece(xs[rank].double(), index, n), "this rank's own piece, not summed: the reduce is missing"),
            (piece(total, index, n) / n, "averaged: the partial results are summed, not averaged"),
            (piece(total, n - 1 - index, n), "the piece of another rank: piece i belongs to group rank i"),
            *_world_sum(xs, index, n)]
        out["wrong_grads"][rank] = [
            (torch.cat([dys[m].double() for m in reversed(group)]),
             "the gathered pieces are in the wrong order: piece i comes from group rank i")]
    return out


# --------------------------------------------------------------------------- 3. the block

def block_reference(case, n):
    """(full block, y, x.grad, {name: grad}, {group index: {name: grad of that rank's tokens only}})."""
    block = mlp_block(**dict(case["full"], device="cpu"))
    x = case["x"].double().clone().requires_grad_()
    y = block(x)
    y.backward(case["dy"].double())
    grads = {name: p.grad.clone() for name, p in block.named_parameters()}
    partial = {}
    for index in range(n):
        block.zero_grad()
        mask = torch.zeros_like(case["dy"].double())
        piece(mask, index, n).fill_(1.0)
        block(case["x"].double()).backward(case["dy"].double() * mask)
        params = dict(block.named_parameters())
        partial[index] = {name: params[name].grad.clone() for name in PARTIAL
                          if name in params and params[name].grad is not None}
    block.zero_grad()
    return block, y.detach(), x.grad, grads, partial


def norm_saved_bytes(case, rows):
    """What nn.LayerNorm keeps for backward on `rows` positions of the case's sequence (measured)."""
    block = mlp_block(**dict(case["full"], device="cpu"))
    x = case["x"].double()[:rows].clone().requires_grad_()
    with LayerNormBytes() as saved:
        block.norm(x)
    return saved.nbytes


def expect_block(case_runs, case, what, rule=""):
    """Every rank of a SequenceParallelMLP case: slices held (copies, not views of the block's weights),
    output piece, input gradient, parameter gradients (the replicated ones: of the rank's own tokens),
    collectives, LayerNorm's saved bytes."""
    sizes = {len(members_of(case.get("groups"), rank, len(case_runs))) for rank in range(len(case_runs))}
    references = {n: block_reference(case, n) for n in sizes}  # groups of different sizes split differently
    for run in case_runs:
        group = members_of(case.get("groups"), run.rank, len(case_runs))
        expect_parameters_held(run, references[len(group)][0], BLOCK, what, group)
        expect_copies(run, what)  # the text: copy the values, into layers of the rank's own
    for run in case_runs:
        group = members_of(case.get("groups"), run.rank, len(case_runs))
        index, n = group.index(run.rank), len(group)
        full, y, x_grad, grads, partial = references[n]
        where = f"{what}: rank {run.rank}"
        expected_y = piece(y, index, n)
        if isinstance(run.output, torch.Tensor) and run.output.shape == y.shape and n > 1:
            raise AssertionError(f"{where}'s output has the whole sequence's shape {tuple(y.shape)}: return "
                                 f"this rank's piece, {tuple(expected_y.shape)} (reduce-scatter, not "
                                 "all-reduce)")
        if not close(run.output, expected_y):
            expect_tensor(run.output, expected_y, f"{where}'s output (its piece of the sequence)",
                          _block_mistakes(case, index, n))
        expect_norm_memory(run, case, index, n, what)
        if run.no_grad:
            raise AssertionError(f"{where}'s output does not require grad: gradients cannot reach the "
                                 "weights")
        if run.input_grad is None:
            raise AssertionError(f"{where}: no gradient reached its piece of x")
        expect_tensor(run.input_grad, piece(x_grad, index, n), f"{where}'s gradient of its piece of x")
        for name, grad in grads.items():
            got = run.grads.get(name)
            if name in PARTIAL:
                want = partial[index].get(name, torch.zeros_like(grad))
                label = (f"{where}'s gradient of {name} (replicated, used on this rank's tokens only: the "
                         f"gradient of its own tokens -- summed over the group it is the full gradient)")
                wrong = [(grad, "the whole sequence's gradient: this rank only saw its own tokens")]
            else:
                want = _slice(grad, BLOCK[name], index, n)
                label, wrong = f"{where}'s gradient of {name} (its slice)", []
            if got is None:
                raise AssertionError(f"{where}: {name} got no gradient")
            expect_tensor(got, want, label, wrong)
        expect_collectives(run, run.forward, [(GATHER, run.output.numel() * F64),
                                              (REDUCE_SCATTER, n * run.output.numel() * F64)],
                           what, "forward", group, rule)
        expect_collectives(run, run.backward, [(GATHER, run.output.numel() * F64),
                                               (REDUCE_SCATTER, n * run.output.numel() * F64)],
                           what, "backward", group, rule)


def _slice(tensor, layout, index, n):
    if layout == "column":
        return tensor.chunk(n, dim=0)[index]
    if layout == "row":
        return tensor.chunk(n, dim=-1)[index]
    return tensor


def _block_mistakes(case, index, n):
    """Known wrong outputs: the residual forgotten, fc2's bias added on every rank before the sum."""
    block = mlp_block(**dict(case["full"], device="cpu"))
    x = case["x"].double()
    with torch.no_grad():
        inner = block.fc2(block.act(block.fc1(block.norm(x))))
        wrong = [(piece(inner, index, n), "the residual x is missing: the block returns x + "
                                          "MLP(LayerNorm(x))")]
        if block.fc2.bias is not None:
            wrong.append((piece(x + inner + (n - 1) * block.fc2.bias, index, n),
                          f"fc2's bias was added on every rank before the reduce-scatter, so summed {n} "
                          "times: "
                          f"add it once, after"))
    return wrong


def expect_norm_memory(run, case, index, n, what):
    """The LayerNorm kept activations for its piece of the sequence only: 1/t of the unsplit block's."""
    rows = piece(case["x"], index, n).shape[0]
    want, whole = norm_saved_bytes(case, rows), norm_saved_bytes(case, case["x"].shape[0])
    if run.saved != want:
        hint = (" -- the LayerNorm ran on the whole gathered sequence: apply it to this rank's piece, then "
                "gather" if run.saved == whole and n > 1 else "")
        raise AssertionError(f"{what}: rank {run.rank}'s LayerNorm saved {run.saved} bytes for backward "
                             f"(shapes {run.saved_shapes}), expected {want} (its {rows} of the "
                             f"{case['x'].shape[0]} positions; the whole sequence: {whole}){hint}")


def tp_equivalent_bytes(runs):
    """(bytes rank 0 sent in the block's forward, in its backward, and what one ring all-reduce of the
    block's whole output sends): the same numbers, when sequence parallelism is done right."""
    run = runs[0]
    n = len(run.group)
    whole = n * run.output.numel() * F64
    return bytes_sent(run.forward), bytes_sent(run.backward), ring_traffic(whole, n)[1]


# --------------------------------------------------------------------------- 4-6. attention

def reference_rows(case, world_size):
    """Each rank's expected output: full attention in float64, at its query positions."""
    q, k, v = case_tensors(case)
    full = attention(q, k, v, causal=case.get("causal", False))
    return [full.index_select(2, p) for p in case_positions(case, world_size)]


def block_bytes(case, positions):
    """Bytes of one message of K and V together (torch.stack((k, v))) for a block of `positions`."""
    b, heads, _, d = case["shape"]
    return 2 * b * heads * len(positions) * d * F64


def _explain_problems(runs, what):
    forbidden = [r for r in runs if r.forbidden]
    if forbidden:
        raise AssertionError(f"{forbidden[0].forbidden.splitlines()[0]} [rank {forbidden[0].rank}] -- {what} "
                             f"passes K/V blocks with send/recv (isend/irecv, batch_isend_irecv) only")
    stuck = [r for r in runs if r.stuck]
    if stuck:
        lines = "; ".join(f"rank {r.rank} {r.stuck}" for r in stuck)
        raise AssertionError(
            f"{what} deadlocked: {lines}. A blocking send waits until its receive is posted: if every rank "
            f"sends first, they wait in a circle. Post the send and the receive of a step together "
            f"(dist.batch_isend_irecv, or isend + irecv, then wait), as the ring of notebook 04 did")


def expect_ring_messages(runs, case, what):
    """N - 1 sends to the next rank and N - 1 receives from the previous one, per rank; step s's send
    carries K and V of block (rank - s) mod N, of the size of that block."""
    _explain_problems(runs, what)
    n = len(runs)
    positions = case_positions(case, n)
    for run in runs:
        sends = [o for o in run.ops if o.op == "send"]
        recvs = [o for o in run.ops if o.op in ("recv", "recv_any_source")]
        others = [o.op for o in run.ops if o.op not in ("send", "recv", "recv_any_source")]
        if others:
            raise AssertionError(f"{what}: rank {run.rank} called {others[0]}: blocks travel by send/recv "
                                 "only")
        if len(sends) != n - 1 or len(recvs) != n - 1:
            raise AssertionError(
                f"{what}: rank {run.rank} sent {len(sends)} and received {len(recvs)} message(s) on {n} "
                f"ranks, expected N - 1 = {n - 1} of each: one message per step with K and V together "
                f"(torch.stack((k, v))), none after the last step")
        for step, (send, recv) in enumerate(zip(sends, recvs, strict=True)):
            nxt, prev = (run.rank + 1) % n, (run.rank - 1) % n
            if send.world_peer != nxt or recv.world_peer != prev:
                raise AssertionError(
                    f"{what}: at step {step} rank {run.rank} sent to rank {send.world_peer} and received "
                    "from "
                    f"rank {recv.world_peer}: pass blocks to the next rank, (rank + 1) % N = {nxt}, and "
                    "receive "
                    f"from the previous one, (rank - 1) % N = {prev} (the direction torch's ring takes)")
            source = (run.rank - step) % n
            want = block_bytes(case, positions[source])
            if send.nbytes != want:
                raise AssertionError(
                    f"{what}: at step {step} rank {run.rank} sent {send.nbytes} bytes, expected {want}: K "
                    "and V "
                    f"of the block it holds then, rank {source}'s ({len(positions[source])} positions: 2 x "
                    f"batch x heads x {len(positions[source])} x d_head x 8 bytes)")


def simulate(case, world_size, rank, source=None, mask_of=None, merge="lse", steps=None, causal=None):
    """Rank's output of a ring written out in float64, with the mistakes `ring_mistakes` names.

    source(rank, step, n): whose block the rank holds at `step` (right: (rank - step) % n);
    mask_of(rank, step, n): whose positions the causal mask (and the trimming) uses (default: source's);
    merge: "lse" (right), "no_rescale" (old output not rescaled), "mean" (block outputs averaged),
    "local_mask" (right merge, causal mask on the indices within the block instead of positions);
    steps: how many. Causal blocks are trimmed as the notebook asks (queries that see a key, keys some
    query sees); None when the mistake cannot be written out (blocks of different lengths).
    """
    q, k, v = case_tensors(case)
    positions = case_positions(case, world_size)
    causal = case.get("causal", False) if causal is None else causal
    source = source or (lambda r, s, n: (r - s) % n)
    mask_of = mask_of or source
    mine = positions[rank]
    qr = q.index_select(2, mine)
    out = torch.zeros_like(qr)
    lse = torch.full(qr.shape[:-1], float("-inf"), dtype=torch.float64)
    outs = []
    for step in range(world_size if steps is None else steps):
        data = positions[source(rank, step, world_size)]
        keys = positions[mask_of(rank, step, world_size)]
        if len(keys) != len(data):
            return None
        rows, cols = torch.arange(len(mine)), torch.arange(len(data))
        if causal:
            rows, cols = rows[mine >= keys.min()], cols[keys <= mine.max()]
            if not (len(rows) and len(cols)):
                continue
        qb, kb, vb = qr[..., rows, :], k.index_select(2, data[cols]), v.index_select(2, data[cols])
        scores = qb @ kb.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if causal:
            qp, kp = (rows, cols) if merge == "local_mask" else (mine[rows], keys[cols])
            scores = scores.masked_fill(kp.view(1, -1) > qp.view(-1, 1), float("-inf"))
        block_lse = torch.logsumexp(scores, dim=-1)
        block_out = (torch.exp(scores - block_lse.unsqueeze(-1)) @ vb).nan_to_num(0.0)
        full_out = torch.zeros_like(qr)
        full_out[..., rows, :] = block_out
        outs.append(full_out)
        old = lse[..., rows]
        new = torch.logaddexp(old, block_lse)
        keep = torch.exp(old - new).nan_to_num(0.0).unsqueeze(-1)
        add = torch.exp(block_lse - new).nan_to_num(0.0).unsqueeze(-1)
        previous = out[..., rows, :]
        out[..., rows, :] = (previous if merge == "no_rescale" else previous * keep) + block_out * add
        lse[..., rows] = torch.where(torch.isinf(new), old, new)
    if merge == "mean":
        return sum(outs) / len(outs) if outs else None
    return out


def ring_mistakes(case, world_size, rank):
    """[(wrong output, what went wrong)] of the ring's known mistakes, for one rank."""
    n, causal = world_size, case.get("causal", False)
    candidates = [
        (dict(steps=1), "only the rank's own block was used: the other blocks never arrived or were not "
                        "merged"),
        (dict(steps=n - 1), f"the block of the last step (step {n - 1}) is missing from the result"),
        (dict(merge="no_rescale"), "the output so far was not rescaled when a block was merged: multiply it "
                                   "by "
                                   "exp(old lse - new lse), and the block's by exp(block lse - new lse)"),
        (dict(merge="mean"), "the blocks' outputs were averaged: weigh each by its share of the softmax, "
                             "exp(block lse - new lse) (the log-sum-exp rule)"),
        (dict(causal=not causal), "the causal mask is " + ("missing" if causal else "applied where it should "
                                                           "not be")),
    ]
    if causal:
        candidates += [
            (dict(merge="local_mask"), "the causal mask compares positions within the blocks (0, 1, ...) "
                                       "instead of the tokens' positions in the whole sequence"),
            (dict(mask_of=lambda r, s, m: (r - s - 1) % m), "the causal mask used the positions of the block "
                                                             "one step before: the block at step s came from "
                                                             "rank (rank - s) % N"),
            (dict(mask_of=lambda r, s, m: (r + s) % m), "the causal mask used the positions of rank "
                                                         "(rank + s) % N at step s: the block at step s came "
                                                         "from rank (rank - s) % N"),
        ]
    out = []
    for kwargs, why in candidates:
        wrong = simulate(case, world_size, rank, **kwargs)
        if wrong is not None:
            out.append((wrong, why))
    return out


def expect_ring_values(runs, case, what):
    """Each rank's output against full attention at its positions (known mistakes explained)."""
    expected = reference_rows(case, len(runs))
    for run in runs:
        where = f"{what}: rank {run.rank}"
        if isinstance(run.output, torch.Tensor) and run.output.is_floating_point() and \
                not torch.isfinite(run.output).all():
            raise AssertionError(f"{where}'s output holds inf or nan {_why_not_finite(runs, run, case)}")
        if close(run.output, expected[run.rank]):
            continue
        expect_tensor(run.output, expected[run.rank], f"{where}'s output (its queries, positions "
                      f"{_positions(run.positions)})", ring_mistakes(case, len(runs), run.rank))


def _not_finite_queries(run):
    """The positions of the rank's queries whose output holds inf or nan."""
    if not (isinstance(run.output, torch.Tensor) and run.output.is_floating_point() and run.output.dim() == 4
            and run.output.shape[2] == len(run.positions)):
        return []
    bad = (~torch.isfinite(run.output)).any(dim=-1).any(dim=0).any(dim=0)
    return [int(p) for p in run.positions[bad]]


def _why_not_finite(runs, run, case):
    """'(first at query position p): why', telling a block the causal mask hides entirely (its scores all
    -inf, lse -inf, and exp(-inf - (-inf)) nan) from an overflow of exp() of large scores: the queries that
    go wrong say which. A query that sees every key of every block cannot meet a hidden block."""
    positions = case_positions(case, len(runs))
    causal = case.get("causal", False)

    def hidden(p):  # the first block whose keys all come after the query at p
        return next((j for j, keys in enumerate(positions) if causal and len(keys) and int(keys.min()) > p),
                    None)

    bad = {p for r in runs for p in _not_finite_queries(r)}
    mine = _not_finite_queries(run)
    first = mine[0] if mine else "?"
    seeing_all = [int(p) for keys in positions for p in keys if hidden(int(p)) is None]
    masked = bad and all(hidden(p) is not None for p in bad) and any(p not in bad for p in seeing_all)
    large = case.get("scale", 1) > 1
    unhidden = next((q for q in sorted(bad) if hidden(q) is None), None)
    if masked or (unhidden is None and not large):
        p = next((q for q in mine if hidden(q) is not None), first)
        j = hidden(p) if isinstance(p, int) else None
        block = (f", which sees none of the keys of rank {j}'s block (positions {_positions(positions[j])})"
                 if j is not None else "")
        return (f"(first at query position {p}{block}): a block the causal mask hides entirely from a "
                "query gives it scores all -inf and lse -inf, and exp(-inf - (-inf)) is nan -- compute a "
                "block only for the queries that see one of its keys (those at positions >= its first), and "
                "skip it for the others")
    if unhidden is None:
        return (f"(first at query position {first}): either exp() of large scores overflowed (subtract the "
                "maximum before exponentiating, as torch.logsumexp does), or a block the causal mask hides "
                "entirely from a query gave it scores all -inf (skip such a block for that query)")
    also = f"; also at position {unhidden}" if unhidden != first else ""
    seen = (f"(first at query position {first}{also}, which sees keys of every block, so no block is hidden "
            "from it)")
    if large:
        return (f"{seen}: exp() of large scores overflowed -- subtract the maximum before exponentiating "
                "(torch.logsumexp does), and merge blocks with the log-sum-exp rule")
    return (f"{seen}: merge blocks with the log-sum-exp rule, exponentiating only differences <= 0 "
            "(exp(lse_block - lse), never a sum of exponentials that can overflow or vanish)")


def _positions(p):
    values = p.tolist()
    if len(values) > 1 and values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}-{values[-1]}"
    return ", ".join(map(str, values[:8])) + (", ..." if len(values) > 8 else "")


def expect_ring(runs, case, what):
    """Messages first (the ring's shape), then values, then the order of transfers and computation."""
    expect_ring_messages(runs, case, what)
    expect_ring_values(runs, case, what)
    expect_transfers_posted_first(runs, what)


def expect_transfers_posted_first(runs, what):
    """Each rank posts the send and the receive of step 0 before it computes anything: the text's rule
    (post the next block's transfer before computing with the current one, wait after), which lets the
    transfer overlap the computation. A ring that computes first and then posts does it at step 0, with
    the rank's own block, which always has work. Counted from the FLOPs torch's FlopCounterMode saw
    before each recorded call (measure.StepRecorder)."""
    for run in runs:
        firsts = [next((i for i, o in enumerate(run.ops) if o.op in kinds), None)
                  for kinds in (("send",), ("recv", "recv_any_source"))]
        if None in firsts or len(run.flops_at) <= max(firsts):
            continue
        done = max(run.flops_at[i] for i in firsts)
        if done:
            raise AssertionError(
                f"{what}: rank {run.rank} did {done:,} FLOPs of attention (of its {run.flops:,}) before "
                "posting the send and the receive of step 0: post the next block's transfer before computing "
                "with the block you hold (at step 0 your own), and wait for it after computing -- posted "
                "after the computation, the transfer cannot overlap it")


def pair_flops(case, q_positions, k_positions):
    """FLOPs of one block pair done the way notebook 12 asks: scores and weighted values for the
    queries that see a key of the block and the keys some query sees (all of them without a mask)."""
    b, heads, _, d = case["shape"]
    rows, cols = len(q_positions), len(k_positions)
    if case.get("causal", False):
        rows = int((q_positions >= k_positions.min()).sum()) if len(k_positions) else 0
        cols = int((k_positions <= q_positions.max()).sum()) if len(q_positions) else 0
    return 4 * b * heads * rows * cols * d


def needed_flops(case, world_size):
    """Per rank: the FLOPs of its block pairs (pair_flops), summed over the N blocks."""
    positions = case_positions(case, world_size)
    return [sum(pair_flops(case, positions[r], positions[s]) for s in range(world_size))
            for r in range(world_size)]


def expect_work(runs, case, what, waste=1.1):
    """No rank computes more than `waste` times the pairs it needs (fully hidden blocks skipped, blocks
    trimmed to the queries and keys that meet): counted with torch's FlopCounterMode."""
    need = needed_flops(case, len(runs))
    for run in runs:
        if run.flops == 0 and need[run.rank]:
            raise AssertionError(f"{what}: torch's FLOP counter saw no matrix product on rank {run.rank}: "
                                 "compute "
                                 f"scores and outputs with @ (torch.matmul), as attention_block does")
        if run.flops > waste * need[run.rank]:
            raise AssertionError(
                f"{what}: rank {run.rank} did {run.flops:,} FLOPs, {run.flops / need[run.rank]:.2f}x the "
                f"{need[run.rank]:,} its causal pairs need: skip a block whose keys all come after every "
                "query, "
                f"and compute a block only for the queries that see one of its keys and the keys some query "
                f"sees")


def expect_balanced(runs, case, what, factor=1.1):
    """Every rank's FLOPs within `factor` of the mean (the balanced split of a causal sequence)."""
    flops = [run.flops for run in runs]
    mean = sum(flops) / len(flops)
    worst = max(range(len(runs)), key=lambda r: flops[r])
    if mean and flops[worst] > factor * mean:
        raise AssertionError(f"{what}: rank {worst} did {flops[worst] / mean:.2f}x the mean work of the "
                             "ranks "
                             f"(FLOPs per rank {flops}), more than {factor}x: the causal work is not "
                             "balanced")


def expect_flat_memory(alone, ring, what, block):
    """The peak memory of the call, measured by PeakMemory with the same block per rank on 1 rank and on
    N ranks, grows by less than 3 K/V blocks: the block arriving, and the one just sent, which its request
    keeps alive until the request is dropped (under gloo as under the grader), but not the blocks already
    used. (A rank that kept every block would hold N - 1 more: on 6 ranks at least 4 more than alone.)

    Measured with the visible test's blocks (4,608 bytes, 6 ranks): the solution grows by 1.6 blocks, correct
    rings written otherwise by 1.5 to 2.6 (separate isend and irecv with the send request kept past its
    step; torch's sigmoid merge), all holding at most 3 blocks at once; a ring that stacks K and V anew
    for every send by 3.6 (4 at once), one that keeps what it received by 4.6 (5 at once). The same
    figures under gloo and under the grader, quiet or loaded: PeakMemory counts tensors' lifetimes, not
    time, and the grader's router keeps a block no longer than gloo does (dpcourse.grading.routed)."""
    grow = max(r.peak for r in ring) - max(r.peak for r in alone)
    if grow < 3 * block:
        return
    rank = max(range(len(ring)), key=lambda r: ring[r].peak)
    held = max(r.most_alive.get(block, 0) for r in ring)
    held_alone = max(r.most_alive.get(block, 0) for r in alone)
    n = len(ring)
    if held >= n - 1:
        why = ("it keeps the blocks it received (or a copy of each): hold only the block you compute with "
               "and the one arriving")
    else:
        why = ("a block of an earlier step is still alive when the next one is allocated: a request of an "
               "earlier step keeps its tensor until the request is dropped (gloo's do too: drop them once "
               "waited for), and a copy made for every send (torch.stack of the received K and V again at "
               "each step) is one more block -- pass the received tensor on as it is")
    raise AssertionError(
        f"{what}: with the same block per rank, the peak memory of the call grew by {grow:,} bytes "
        f"({grow / block:.1f} K/V blocks of {block:,} bytes) from 1 rank to {n}, 3 blocks or more: it held "
        f"up to {held} tensors of a K/V block's size at once ({held_alone} alone). A ring "
        f"needs 3 at most: the block it computes with, the one arriving, and the one it just sent -- {why}"
        f"\n(rank {rank}: {ring[rank].peak:,} bytes at the peak on {n} ranks, "
        f"{max(r.peak for r in alone):,} alone)")


def expect_ulysses(runs, case, what):
    """Each rank's output, and its communication: the all-to-all(s) of q, k, v (one call with the three
    stacked, or one each), then one all-to-all of the output; nothing else."""
    n = len(runs)
    b, heads, seq, d = case["shape"]
    expected, whole = reference_rows(case, n), reference_rows(case, 1)[0]
    for run in runs:
        where = f"{what}: rank {run.rank}"
        label = f"{where}'s output (its queries, positions {_positions(run.positions)})"
        located = "" if close(run.output, expected[run.rank]) else \
            _first_difference(run.output, expected[run.rank], run.positions, whole)
        if located:
            raise AssertionError(f"{label} is wrong: {located}")
        expect_tensor(run.output, expected[run.rank], label)
        mine = b * heads * len(run.positions) * d * F64
        back = b * (heads // n) * seq * d * F64
        got = [(o.op, o.nbytes) for o in run.ops if o.op != "barrier"]
        shapes = ([(ALL_TO_ALL, 3 * mine), (ALL_TO_ALL, back)],
                  [(ALL_TO_ALL, mine)] * 3 + [(ALL_TO_ALL, back)])
        if n == 1 and all(op in ALL_TO_ALL for op, _ in got) and len(got) in (0, 2, 4):
            continue
        if not any(len(got) == len(s) and all(op in names and nbytes == size
                                               for (op, nbytes), (names, size) in zip(got, s, strict=True))
                   for s in shapes):
            raise AssertionError(
                f"{where} issued {', '.join(f'{op} of {nbytes} bytes' for op, nbytes in got) or 'nothing'}; "
                f"expected an all-to-all of q, k and v ({3 * mine} bytes in one call, or {mine} in each of "
                f"three), then one of the output ({back} bytes: its {heads // n} heads for all {seq} "
                "positions)")


def _first_difference(got, expected, positions, whole):
    """'first wrong at batch i, head h, position p: x, expected y' for an attention output (batch, heads,
    len, d), and
    whose expected row it holds instead, if any: values that only print alike show where they differ, and a
    piece in the wrong place (batch, head or position) says which. whole: the expected output of every
    position (batch, heads, seq, d)."""
    if not (isinstance(got, torch.Tensor) and got.shape == expected.shape and got.dim() == 4):
        return ""
    wrong = ~torch.isclose(got.double(), expected.double(), atol=ATOL, rtol=RTOL)
    if not wrong.any():
        return ""
    bi, hi, si, _ = (int(i) for i in wrong.nonzero()[0])
    text = (f"first wrong at batch {bi}, head {hi}, position {int(positions[si])}: "
            f"{float(got[bi, hi, si, 0]):.6g}, ... expected {float(expected[bi, hi, si, 0]):.6g}, ...")
    row = got[bi, hi, si].double()
    match = (torch.isclose(whole.double(), row, atol=ATOL, rtol=RTOL).all(dim=-1)).nonzero()
    if len(match):
        b2, h2, p2 = (int(i) for i in match[0])
        text += (f" -- that row is the expected row of batch {b2}, head {h2}, position {p2}: a piece in the "
                 "wrong place")
    return text


def attention_bytes_sent(runs):
    """Bytes each rank put on the network: its sends, or what it sent to others in its all-to-alls
    (an all-to-all keeps 1/N of a rank's input at home when the pieces are equal)."""
    n = len(runs)
    out = []
    for run in runs:
        sent = 0.0
        for o in run.ops:
            if o.op == "send":
                sent += o.nbytes
            elif o.op in ALL_TO_ALL:
                sent += o.nbytes * (n - 1) / n
            elif o.op not in ("recv", "barrier"):
                sent += bytes_sent([o])
        out.append(sent)
    return out


# --------------------------------------------------------------------------- 5. balanced_positions

def expect_positions(got, seq_len, world_size, what):
    """got = balanced_positions(seq_len, world_size): every rank's positions, pieces r and 2N - 1 - r."""
    want = head_tail_positions(seq_len, world_size)
    if not (isinstance(got, (list, tuple)) and len(got) == world_size):
        raise AssertionError(f"{what} should return a list of {world_size} tensors (one per rank), got "
                             f"{type(got).__name__} of length {len(got) if hasattr(got, '__len__') else '?'}")
    for rank, (mine, expected) in enumerate(zip(got, want, strict=True)):
        if not isinstance(mine, torch.Tensor) or mine.dtype != torch.int64 or mine.dim() != 1:
            raise AssertionError(f"{what}: rank {rank}'s positions should be a 1-D int64 tensor, got "
                                 f"{mine.dtype if isinstance(mine, torch.Tensor) else type(mine).__name__}")
        if torch.equal(mine, expected):
            continue
        pieces = [(a, b) for a, b in _bounds(seq_len, 2 * world_size)]
        hint = ""
        if sorted(mine.tolist()) == expected.tolist():
            hint = " -- the right positions, not ascending: put piece r first, then piece 2N - 1 - r"
        elif torch.equal(mine, contiguous_positions(seq_len, world_size)[rank]):
            hint = (" -- the contiguous split: the balanced one takes a piece from the head and one from the "
                    "tail")
        raise AssertionError(
            f"{what}: rank {rank} holds {_positions(mine)}, expected pieces {rank} and "
            f"{2 * world_size - 1 - rank} "
            f"of {2 * world_size} (torch.arange({seq_len}).tensor_split({2 * world_size}): "
            f"{', '.join(_piece(a, b) for a, b in pieces)}): "
            f"{_positions(expected)}{hint}")


def _piece(start, stop):
    return "empty" if stop <= start else str(start) if stop == start + 1 else f"{start}-{stop - 1}"


def _bounds(length, count):
    return [(int(p[0]), int(p[-1]) + 1) if len(p) else (0, 0)
            for p in torch.arange(length).tensor_split(count)]


def causal_pairs(positions, seq_len):
    """Per rank: how many (query, key) pairs its queries have under the causal mask (a query at i sees
    i + 1 keys)."""
    return [visible_pairs(p, torch.arange(seq_len), causal=True) for p in positions]


def expect_balanced_pairs(positions, seq_len, what, factor=1.05):
    """Every rank's causal pairs within `factor` of the mean."""
    pairs = causal_pairs(positions, seq_len)
    mean = sum(pairs) / len(pairs)
    worst = max(range(len(pairs)), key=lambda r: pairs[r])
    if pairs[worst] > factor * mean:
        raise AssertionError(f"{what}: rank {worst}'s queries have {pairs[worst]} causal (query, key) pairs, "
                             f"{pairs[worst] / mean:.2f}x the mean ({pairs}): not balanced")
