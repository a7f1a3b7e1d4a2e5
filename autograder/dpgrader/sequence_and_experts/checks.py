"""Hidden checks of 12_sequence_and_experts. Each raises a short AssertionError saying what is wrong.

Every learner object is built and run inside launched ranks (dpcourse.topics.sequence.runs,
dpcourse.topics.experts.runs); what comes back is plain tensors, records and measurements.
Expected values are computed here, in the test cell's process: torch.distributed's semantics
written out for the two operators, the unsharded float64 MLP block, attention written out in
float64 on the whole sequence, and the single-process mixture-of-experts layer (plain loops) on
each rank's tokens. With the visible tests, cases cover N = 1, 2, 3 and 4 (sub-groups of 4 ranks
cover several group sizes in one launch), sequence lengths that do not split evenly, both splits of a
causal sequence and an interleaved one, scores in the thousands, experts that receive no token and
every token routed to one expert. Several cases share a launch: grading the chapter costs launches.
"""

import torch

from dpcourse.checks.tensors import expect_operator
from dpcourse.topics.experts.checks import expect_aux_gradient, expect_moe, expect_routing
from dpcourse.topics.experts.models import tokens_towards
from dpcourse.topics.experts.runs import run_moe_cases
from dpcourse.topics.sequence.checks import (
    expect_balanced,
    expect_balanced_pairs,
    expect_block,
    expect_positions,
    expect_ring,
    expect_ulysses,
    expect_work,
    gather_semantics,
    reduce_scatter_semantics,
)
from dpcourse.topics.sequence.models import inputs
from dpcourse.topics.sequence.runs import run_attention_cases, run_block_cases, run_operator_cases

# What each exercise's expected values come from (autograder/exercises.json lists them).
REFERENCES = {
    "gather_sequence": "torch.distributed's semantics written out (all-gather along dim 0 forward, "
                       "reduce-scatter of the gradients backward)",
    "reduce_scatter_sequence": "torch.distributed's semantics written out (reduce-scatter along dim 0 "
                               "forward, "
                               "all-gather backward)",
    "sequence_parallel_mlp": "the unsharded float64 MLP block on the whole sequence and its gradients; "
                             "nn.LayerNorm's "
                             "saved bytes on the rank's piece, measured in the test process",
    "ring_attention": "attention written out in float64 on the whole sequence "
                      "(dpcourse.topics.sequence.models."
                      "attention); the causal pairs each rank needs, counted from the positions",
    "balanced_positions": "torch.tensor_split's pieces r and 2N - 1 - r (torch's _HeadTailLoadBalancer), "
                          "written out",
    "ulysses_attention": "attention written out in float64 on the whole sequence; the all-to-all sizes from "
                         "the "
                         "shapes",
    "route_tokens": "dpcourse.topics.experts.models: top-k, capacity served in order, Switch Transformer's "
                    "alpha E sum f_i P_i, written with loops",
    "expert_parallel_moe": "the single-process mixture-of-experts layer (plain loops) on each rank's tokens, "
                           "and "
                           "autograd on it; the all-to-all sizes from its routing",
}

# One launch of 4 ranks covers every group size: the whole world (N = 4), two pairs (N = 2, contiguous
# or not), and a group of 3 next to a group of 1 (N = 3 and N = 1).
GROUPINGS = [None, [[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0, 1, 2], [3]]]


def _label(groups, world=4):
    return f"{world} rank(s)" + (f", groups {groups}" if groups else "")


# --------------------------------------------------------------------------- 1-2. the operators

def _operator_cases(piece_shapes, seed, gathers):
    """Every grouping of 4 ranks, each rank its own x; pieces of `piece_shapes` (the whole sequence is
    N pieces long, N the size of the rank's group)."""
    cases = []
    for groups in GROUPINGS:
        size = {r: len(next(g for g in groups if r in g)) if groups else 4 for r in range(4)}
        for shape in piece_shapes:
            wholes = [(shape[0] * size[r], *shape[1:]) for r in range(4)]
            xs, grads = (shape, wholes) if gathers else (wholes, shape)
            cases.append(dict(inputs=[inputs(_of(xs, r), seed + 10 * r) for r in range(4)],
                              grads=[inputs(_of(grads, r), seed + 10 * r + 5) for r in range(4)],
                              groups=groups, label=f"{_label(groups)}, pieces of shape {shape}"))
            seed += 100
    return cases


def _of(shapes, rank):
    """A shape, or rank's shape from a list of them."""
    return shapes[rank] if isinstance(shapes, list) else shapes


def _check_operator(fn, exercise, semantics, rule, gathers):
    cases = _operator_cases([(3, 2, 4), (1, 5)], seed=1, gathers=gathers)
    for case, runs in zip(cases, run_operator_cases(fn, 4, cases, exercise=exercise), strict=True):
        expect_operator(runs, case, semantics(case, 4), f"{exercise} on {case['label']}", rule)


def check_gather_sequence(gather_sequence):
    _check_operator(gather_sequence, "gather_sequence", gather_semantics,
                    "g: one all-gather over the group forward, one reduce-scatter over the group "
                    "backward", True)


def check_reduce_scatter_sequence(reduce_scatter_sequence):
    """(The visible part of the same test cell checks the ValueError for a length that does not split.)"""
    _check_operator(reduce_scatter_sequence, "reduce_scatter_sequence", reduce_scatter_semantics,
                    "ḡ: one reduce-scatter over the group forward, one all-gather over the group "
                    "backward", False)


# --------------------------------------------------------------------------- 3. the block

def check_sequence_parallel_mlp(SequenceParallelMLP):
    cases = []
    # (the visible test runs groups [0, 1] and [2, 3])
    for seed, (groups, bias, seq, batch) in enumerate([(None, True, 4, 2), ([[0, 2], [1, 3]], False, 2, 3),
                                                        ([[0, 1, 2], [3]], True, 6, 1)], start=300):
        cases.append(dict(full=dict(d_model=6, d_hidden=12, bias=bias, seed=seed),
                          x=inputs((seq, batch, 6), seed + 1), dy=inputs((seq, batch, 6), seed + 2),
                          groups=groups, label=f"{_label(groups)}, bias={bias}, {seq} positions"))
    runs = run_block_cases(SequenceParallelMLP, 4, cases, exercise="SequenceParallelMLP")
    for case, case_runs in zip(cases, runs, strict=True):
        expect_block(case_runs, case, f"SequenceParallelMLP on {case['label']}",
                     rule="one all-gather and one reduce-scatter over the group in each direction")


# --------------------------------------------------------------------------- 4. ring attention

def _attention_cases(world):
    """One rank alone; on 3 ranks both splits (lengths that do not split evenly), causal or not, scores in the
    thousands, and an interleaved split (rank r holds r, r + N, ...). The visible tests run 2 and 4 ranks."""
    if world == 1:
        cases = [dict(shape=(2, 1, 5, 3), seeds=(4, 5, 6), positions="balanced", causal=True)]
    else:
        seq = 3 * world + 1
        cases = [dict(shape=(2, 1, 3 * world, 3), seeds=(4, 5, 6), positions="balanced", causal=True),
                 dict(shape=(1, 3, 2 * world + 3, 4), seeds=(7, 8, 9), positions="balanced", causal=False),
                 dict(shape=(1, 2, 4 * world + 1, 4), seeds=(1, 2, 3), positions="contiguous", causal=True,
                      scale=30.0),
                 dict(shape=(1, 2, seq, 4), seeds=(13, 14, 15), causal=True,
                      positions=[list(range(r, seq, world)) for r in range(world)])]
    for case in cases:
        split = case["positions"] if isinstance(case["positions"], str) else "interleaved"
        case["label"] = (f"{world} rank(s), {case['shape'][2]} positions, {split} split, "
                         f"{'causal' if case['causal'] else 'not causal'}"
                         + (", scores in the thousands" if case.get("scale") else ""))
    return cases


def check_ring_attention(ring_attention):
    """1 and 3 ranks (the visible tests run 2 and 4)."""
    for world in (1, 3):
        cases = _attention_cases(world)
        runs = run_attention_cases(ring_attention, world, cases, exercise="ring_attention", p2p_only=True)
        for case, case_runs in zip(cases, runs, strict=True):
            expect_ring(case_runs, case, f"ring_attention on {case['label']}")


def check_ring_attention_work(ring_attention):
    """On 3 ranks (the visible test runs 4): the head-and-tail split balanced, no wasted work on either split.
    (The visible test measures the memory, 1 rank against 6.)"""
    world, seq = 3, 30
    cases = [dict(shape=(1, 2, seq, 8), seeds=(20, 21, 22), positions=split, causal=True,
                  label=f"{world} ranks, causal, {split} split of {seq} positions")
             for split in ("balanced", "contiguous")]
    runs = run_attention_cases(ring_attention, world, cases, exercise="ring_attention", p2p_only=True)
    for case, case_runs in zip(cases, runs, strict=True):
        expect_ring(case_runs, case, f"ring_attention on {case['label']}")
        expect_work(case_runs, case, f"ring_attention on {case['label']}")
        if case["positions"] == "balanced":
            expect_balanced(case_runs, case, f"ring_attention on {case['label']}")


# --------------------------------------------------------------------------- 5. balanced positions

def check_balanced_positions(balanced_positions):
    for seq_len, world in [(8, 1), (9, 2), (5, 2), (30, 4), (12, 3), (101, 5), (6, 3)]:
        expect_positions(balanced_positions(seq_len, world), seq_len, world,
                         f"balanced_positions({seq_len}, {world})")
    for seq_len, world in [(120, 4), (96, 3)]:
        expect_balanced_pairs(balanced_positions(seq_len, world), seq_len,
                              f"balanced_positions({seq_len}, {world})", factor=1.05)


# --------------------------------------------------------------------------- 6. Ulysses

def check_ulysses_attention(ulysses_attention):
    """1 and 3 ranks (the visible tests run 2 and 4, and the ValueError for heads that do not split)."""
    layouts = {1: [((1, 2, 5, 4), "contiguous", True)],
               3: [((2, 6, 10, 4), "contiguous", True), ((1, 6, 14, 2), "balanced", True),
                   ((2, 3, 9, 3), "contiguous", False)]}
    for world, shapes in layouts.items():
        cases = [dict(shape=shape, seeds=(30, 31, 32), positions=split, causal=causal,
                      label=f"{world} rank(s), {shape[1]} heads, {shape[2]} positions, {split} split, "
                            f"{'causal' if causal else 'not causal'}")
                 for shape, split, causal in shapes]
        runs = run_attention_cases(ulysses_attention, world, cases, exercise="ulysses_attention")
        for case, case_runs in zip(cases, runs, strict=True):
            expect_ulysses(case_runs, case, f"ulysses_attention on {case['label']}")


# --------------------------------------------------------------------------- 7. routing

def check_route_tokens(route_tokens):
    g = torch.Generator().manual_seed(7)
    one_expert = torch.randn(9, 4, generator=g, dtype=torch.float64)
    one_expert[:, 2] += 20.0  # every token's first choice: expert 2
    cases = [
        (torch.randn(12, 4, generator=g, dtype=torch.float64), 1, 1.0),
        (torch.randn(12, 4, generator=g, dtype=torch.float64), 2, 1.25),
        (torch.randn(7, 3, generator=g, dtype=torch.float64), 2, 0.5),
        (torch.randn(16, 8, generator=g, dtype=torch.float64), 2, 2.0),
        (torch.randn(1, 4, generator=g, dtype=torch.float64), 2, 1.0),  # one token
        (torch.randn(5, 1, generator=g, dtype=torch.float64), 1, 1.0),  # one expert
        (one_expert, 1, 1.0),
        (one_expert, 2, 1.0),
    ]
    for logits, k, capacity_factor in cases:
        expect_routing(route_tokens(logits, k, capacity_factor), logits, k, capacity_factor,
                       f"route_tokens(logits of {logits.shape[0]} tokens x {logits.shape[1]} experts, k={k}, "
                       f"capacity_factor={capacity_factor})")
    expect_aux_gradient(route_tokens, [cases[1], cases[2], cases[3], cases[7]])  # top-2, one launch


# --------------------------------------------------------------------------- 8. expert parallelism

def check_expert_parallel_moe(ExpertParallelMoE, route_tokens=None):
    """One launch of 4 ranks, three layers: 8 experts over the world; 6 experts over a group of 3 (a skewed
    router: some experts get no token) next to a group of 1 holding all 6; 4 experts over two pairs with
    every token sent to expert 1."""
    layouts = [  # (groups, full layer, tokens per rank, every token to one expert); the pairs last: a layer
        # that takes its experts by world rank fails on ranks 2 and 3 there, with no peer left waiting
        (None, dict(d_model=4, d_hidden=6, n_experts=8, k=2, capacity_factor=0.5, seed=44), [3, 8, 5, 6],
         False),
        ([[0, 1, 2], [3]], dict(d_model=4, d_hidden=5, n_experts=6, k=2, capacity_factor=1.0, seed=42,
                                router_scale=6.0), [4, 2, 5, 7], False),
        ([[0, 1], [2, 3]], dict(d_model=4, d_hidden=6, n_experts=4, k=1, capacity_factor=2.0, seed=43),
         [6, 5, 4, 3], True),
    ]
    cases = []
    for groups, full, tokens, one_expert in layouts:
        if one_expert:
            xs = [tokens_towards(full, 1, t, 50 + r) for r, t in enumerate(tokens)]
        else:
            xs = [inputs((t, full["d_model"]), 50 + r) for r, t in enumerate(tokens)]
        cases.append(dict(full=full, xs=xs, groups=groups,
                          dys=[inputs((t, full["d_model"]), 60 + r) for r, t in enumerate(tokens)],
                          label=(f"{_label(groups)}, {full['n_experts']} experts, top-{full['k']}, capacity "
                                 "factor "
                                 f"{full['capacity_factor']}, tokens per rank {tokens}"
                                 + (", every token to expert 1" if one_expert else ""))))
    runs = run_moe_cases(ExpertParallelMoE, 4, cases, exercise="ExpertParallelMoE")
    for case, case_runs in zip(cases, runs, strict=True):
        expect_moe(case_runs, case, f"ExpertParallelMoE on {case['label']}", route_tokens=route_tokens)


__all__ = ["check_gather_sequence", "check_reduce_scatter_sequence", "check_sequence_parallel_mlp",
           "check_ring_attention", "check_ring_attention_work", "check_balanced_positions",
           "check_ulysses_attention", "check_route_tokens", "check_expert_parallel_moe"]
