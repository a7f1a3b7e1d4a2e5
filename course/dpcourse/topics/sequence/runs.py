"""Run a learner's sequence- or context-parallel code on ranks; plain results and records back.

    runs = run_block_cases(SequenceParallelMLP, 2, cases, exercise="SequenceParallelMLP")
    runs[case][rank].output, .input_grad, .params, .grads, .forward, .backward, .saved

    runs = run_attention_cases(ring_attention, 4, cases, exercise="ring_attention", p2p_only=True)
    runs[case][rank].output, .ops, .flops_at, .flops, .peak, .positions

Why a module: notebook 12's visible tests, hidden checks and demos run the learner's code the
same way. These are its per-case functions on the course's one case runner (dpcourse.comm.cases),
which sends each rank its own part of a case only -- its piece of the sequence, its rows of q, k
and v, worked out here in the caller -- and reports what the ranks did (the router's records of
their calls while graded). Each rank builds the learner's object itself, runs it under the recorder
and the measurements of `measure`, and returns plain values; expected values are computed by the
caller (`checks`) from the unsharded float64 reference, never in the ranks. The attention cases are
replayed while graded (dpcourse.comm.provenance.Copies): the K/V blocks of the ring and what goes
into Ulysses' all-to-alls must be copies of data a rank had (or, for Ulysses' second all-to-all and
every rank's output, attention values it could compute from what had reached it), so a rank that
computes its output alone and sends zeros loses the cell.

The operators (gather_sequence, reduce_scatter_sequence) run on dpcourse.comm.operators, as notebook
08's f and g do.

Cases (dicts):
  block cases:     full (mlp_block's keyword arguments), x and dy (the whole (seq, batch, d)
                   tensors: rank r is sent its contiguous piece of dim 0), groups (None: the world;
                   else lists of world ranks), label
  attention cases: shape (batch, heads, seq, d_head), seeds (of q, k, v), scale (multiplies
                   q and k: large scores test the log-sum-exp rule), positions ("contiguous",
                   "balanced" or a list of position lists), causal, label
"""

import math

import torch

from dpcourse.backend import rank_device
from dpcourse.comm.cases import Case, members_of, run_cases
from dpcourse.comm.operators import backward_of, parameters_of, run_operator_cases, tensor_or_none, views_of
from dpcourse.comm.provenance import Copies
from dpcourse.topics.sequence.measure import LayerNormBytes, PeakMemory, StepRecorder
from dpcourse.topics.sequence.models import (
    attention,
    contiguous_positions,
    head_tail_positions,
    inputs,
    mlp_block,
)

__all__ = ["run_operator_cases", "run_block_cases", "run_attention_cases", "case_positions", "case_tensors",
           "piece"]

BLOCK_DEFAULTS = {"output": None, "input_grad": None, "params": {}, "grads": {}, "no_grad": False,
                  "saved": None, "saved_shapes": [], "views": {}}


# --------------------------------------------------------------------------- the MLP block

def piece(tensor, index, count):
    """Rank `index`'s contiguous piece of dim 0 (the sequence) out of `count`."""
    return tensor.chunk(count, dim=0)[index]


def block_case(cls, part, ctx):
    """Rank side: cls(mlp_block(**full), group) on this rank's piece of x, backward with its piece of dy."""
    x, dy = (t.to(rank_device()).clone() for t in part)
    x.requires_grad_()
    ctx.phase("build")
    full = mlp_block(**ctx.shared)
    module = ctx.call(cls, full, ctx.group)
    ctx.phase("forward")
    with LayerNormBytes() as saved:
        output = ctx.call(module, x)
    report = {"output": tensor_or_none(output), "saved": saved.nbytes, "saved_shapes": saved.shapes,
              "views": views_of(module, full)}
    backward_of(report, output, dy, ctx)
    report["input_grad"] = tensor_or_none(x.grad)
    return {**report, **parameters_of(module)}


def block_case_of(case, world_size):
    """A block case as the case runner's Case: rank r is sent its pieces of x and dy, and the block's
    arguments (every rank builds the whole block: its weights are replicated in sequence parallelism)."""
    parts = []
    for rank in range(world_size):
        group = members_of(case.get("groups"), rank, world_size)
        index, count = group.index(rank), len(group)
        parts.append((piece(case["x"], index, count), piece(case["dy"], index, count)))
    return Case(parts=parts, shared=dict(case["full"]), groups=case.get("groups"), label=case.get("label"),
                about=case)


def run_block_cases(cls, world_size, cases, *, exercise, group_timeout=None, deadline=None):
    """Launch world_size ranks; each case builds cls(mlp_block(**full), group), runs forward on the
    rank's piece of x and backward with its piece of dy. Returns runs[case][rank]."""
    runnable = [block_case_of(c, world_size) for c in cases]
    return run_cases(block_case, cls, world_size, runnable, exercise=exercise, group_timeout=group_timeout,
                     deadline=deadline, defaults=BLOCK_DEFAULTS)


# --------------------------------------------------------------------------- attention

RING_ADVICE = (
    "A blocking send waits until its receive is posted: if every rank sends first, they wait in a circle. "
    "Post the send and the receive of a step together (dist.batch_isend_irecv, or isend + irecv, then "
    "wait), as the ring of notebook 04 did.")


def case_positions(case, world_size):
    """The case's split of the sequence: a list of LongTensors, one per rank."""
    layout, seq = case.get("positions", "contiguous"), case["shape"][2]
    if layout == "contiguous":
        return contiguous_positions(seq, world_size)
    if layout == "balanced":
        return head_tail_positions(seq, world_size)
    return [torch.as_tensor(p, dtype=torch.long) for p in layout]


def case_tensors(case):
    """(q, k, v) of the whole sequence, float64 on the CPU: what the caller splits and the checks rebuild."""
    shape, scale = tuple(case["shape"]), case.get("scale", 1.0)
    sq, sk, sv = case.get("seeds", (1, 2, 3))
    return inputs(shape, sq, scale=scale), inputs(shape, sk, scale=scale), inputs(shape, sv)


def attention_case(fn, part, ctx):
    """Rank side: fn(q, k, v, positions, causal) on this rank's rows, its messages and the FLOPs done
    before each (StepRecorder), and the peak memory of what it created (PeakMemory)."""
    q, k, v = (t.to(rank_device()).contiguous() for t in part)
    recorder, peak = StepRecorder(exercise=ctx.exercise), PeakMemory()
    with recorder, peak:
        output = ctx.call(fn, q, k, v, ctx.shared["positions"], ctx.shared["causal"])
    return {"output": output.detach().clone() if isinstance(output, torch.Tensor) else output,
            "flops_at": list(recorder.flops_at), "flops": recorder.total_flops, "peak": peak.peak_bytes,
            "most_alive": sorted(peak.most_alive.items())}


def attention_case_of(case, world_size, ring):
    """An attention case as the case runner's Case: rank r is sent its rows of q, k and v (its positions
    of the sequence) and the layout; the replay of what may travel (see the module docstring)."""
    positions = case_positions(case, world_size)
    q, k, v = case_tensors(case)
    parts = [tuple(t.index_select(2, p) for t in (q, k, v)) for p in positions]
    causal = case.get("causal", False)
    full = attention(q, k, v, causal=causal)
    if ring:
        derived = ring_derived(parts, positions, full, causal)
    else:
        derived = ulysses_derived(parts, full, q.shape[1])
    return Case(parts=parts, shared={"positions": positions, "causal": causal}, label=case.get("label"),
                replay=Copies([list(p) for p in parts], derived=derived, finals=("output",)), about=case)


def ring_derived(parts, positions, full, causal):
    """Per rank, its output (full attention at its queries) once it knows its queries and the keys and
    values of every position one of them sees."""
    derived = []
    for rank, mine in enumerate(positions):
        needs = {}
        for other, (q, k, _) in enumerate(parts):
            seen = (positions[other].view(-1, 1) <= mine.max()).view(-1) if causal else \
                torch.ones(len(positions[other]), dtype=torch.bool)
            kv = seen.view(1, 1, -1, 1).expand(k.shape)
            own = torch.full((q.numel(),), other == rank)
            needs[other] = torch.cat([own, kv.reshape(-1), kv.reshape(-1)])
        derived.append([(needs, full.index_select(2, mine))])
    return derived


def ulysses_derived(parts, full, heads):
    """Per rank m, attention over its heads (heads // N of them, in order) for every position, once it
    knows those heads' q, k and v at every position; and its own queries scaled by 1/sqrt(d_head), which
    a rank may send instead of the queries."""
    n = len(parts)
    per = heads // n if heads % n == 0 else heads
    derived = []
    for rank in range(n):
        chosen = torch.zeros(heads, dtype=torch.bool)
        chosen[rank * per:(rank + 1) * per] = True
        needs = {}
        for other, (q, _, _) in enumerate(parts):
            mask = chosen.view(1, -1, 1, 1).expand(q.shape).reshape(-1)
            needs[other] = torch.cat([mask, mask, mask])
        scaled = parts[rank][0] / math.sqrt(parts[rank][0].shape[-1])
        derived.append([(needs, full[:, chosen]), (None, scaled)])
    return derived


def run_attention_cases(fn, world_size, cases, *, exercise, p2p_only=False, group_timeout=None,
                        deadline=None):
    """Launch world_size ranks; in each case rank r calls fn(q_r, k_r, v_r, positions, causal) with its
    rows of q, k, v. Returns runs[case][rank] (ops: the router's records while graded; positions: the
    rank's query positions).

    p2p_only: collectives are refused (the ring, replayed as one: its messages are K/V blocks); else
    the case is replayed as Ulysses' all-to-alls."""
    runnable = [attention_case_of(case, world_size, ring=p2p_only) for case in cases]
    runs = run_cases(attention_case, fn, world_size, runnable, exercise=exercise, p2p_only=p2p_only,
                     group_timeout=group_timeout, deadline=deadline, advice=RING_ADVICE if p2p_only else None,
                     defaults={"output": None, "flops_at": [], "flops": 0, "peak": 0, "most_alive": []})
    for case, case_runs in zip(runnable, runs.unchecked, strict=True):
        for run in case_runs:
            run.values["positions"] = case.shared["positions"][run.rank]
            # storage size -> the most storages of that size alive at once (PeakMemory)
            run.values["most_alive"] = {int(size): int(count) for size, count in run.values["most_alive"]}
    return runs
