"""Hidden checks of 08_tensor_parallelism. Each raises a short AssertionError saying what is wrong.

Every learner object is built and run inside launched ranks by dpcourse.topics.tensor.runs,
under the recorder; what comes back is plain tensors and CommOp records. Expected values are
computed here, in the test cell's process: torch.distributed's semantics written out for the
operators (checks.*_semantics), the unsharded float64 module for the layers, and the same
module trained in one process for training. Cases cover N = 1, 2 and 4, sub-groups of 4 ranks
([0, 1] and [2, 3], then [0, 2] and [1, 3]: an all-reduce on the whole world, or a slice taken
by world rank, is caught by who took part), bias on and off, 2-D and 3-D inputs, and feature or
head counts that N does not divide (a ValueError whose message gives both numbers). Every module
check also refuses parameters that are views of the unsharded module's, and every operator check
a backward that changes the gradient it was handed.
"""

import torch

from dpcourse.topics.tensor.checks import (
    ATTENTION,
    COLUMN,
    MLP,
    ROW,
    attention_mistakes,
    column_mistakes,
    expect_module,
    expect_operator,
    expect_refusal,
    expect_training,
    f_semantics,
    g_semantics,
    gather_semantics,
    row_mistakes,
)
from dpcourse.topics.tensor.models import inputs
from dpcourse.topics.tensor.runs import run_module_cases, run_operator_cases, run_training

# What each exercise's expected values come from (autograder/exercises.json lists them).
REFERENCES = {
    "copy_to_tp": "torch.distributed's semantics written out (f: identity forward, all-reduce backward)",
    "reduce_from_tp": "torch.distributed's semantics written out (g: all-reduce forward, identity backward)",
    "gather_from_tp": "torch.distributed's semantics written out (all-gather forward, slice backward)",
    "column_parallel_linear": "the unsharded float64 nn.Linear on the same input, and its gradients",
    "row_parallel_linear": "the unsharded float64 nn.Linear on the same input, and its gradients",
    "tensor_parallel_mlp": "the unsharded float64 MLP, and the same MLP trained in one process",
    "tensor_parallel_attention": "the unsharded float64 attention block, and its gradients",
}

WORLDS = {1: [None], 2: [None, [[0, 1]]], 4: [[[0, 1], [2, 3]], [[0, 2], [1, 3]], None]}
F64 = 8


def _groups_label(groups, world):
    return f"{world} rank(s)" + (f", groups {groups}" if groups else "")


# --------------------------------------------------------------------------- 1-3. operators

def _operator_cases(world, shapes, seed, gathers=False):
    """x of each shape on every rank; the output gradients have the output's shape (N times wider for
    a gather)."""
    cases = []
    for groups in WORLDS[world]:
        n = len(groups[0]) if groups else world
        for shape in shapes:
            grad_shape = shape[:-1] + (shape[-1] * n,) if gathers else shape
            cases.append(dict(inputs=[inputs(shape, seed + 10 * r) for r in range(world)],
                              grads=[inputs(grad_shape, seed + 10 * r + 5) for r in range(world)],
                              groups=groups,
                              label=f"{_groups_label(groups, world)}, x of shape {shape}"))
            seed += 100
    return cases


def _check_operator(fn, exercise, semantics, shapes, rule):
    for world in WORLDS:
        cases = _operator_cases(world, shapes, seed=world, gathers=exercise == "gather_from_tp")
        for case, runs in zip(cases, run_operator_cases(fn, world, cases, exercise=exercise), strict=True):
            expect_operator(runs, case, semantics(case, world), f"{exercise} on {case['label']}", rule)


def check_copy_to_tp(copy_to_tp):
    _check_operator(copy_to_tp, "copy_to_tp", f_semantics, [(3, 4), (2, 3, 2)],
                    "f: the identity forward, one all-reduce of the gradient over the group backward")


def check_reduce_from_tp(reduce_from_tp):
    _check_operator(reduce_from_tp, "reduce_from_tp", g_semantics, [(3, 4), (2, 3, 2)],
                    "g: one all-reduce over the group forward, the identity backward")


def check_gather_from_tp(gather_from_tp):
    _check_operator(gather_from_tp, "gather_from_tp", gather_semantics, [(3, 2), (2, 2, 3)],
                    "one all-gather over the group forward; backward, this rank's slice, no communication")


# --------------------------------------------------------------------------- 4-5. linear layers

def _layer_cases(world, kind, seed):
    """Column or row cases: bias on/off, both options, 2-D and 3-D inputs, every grouping of `world`."""
    cases = []
    for groups in WORLDS[world]:
        for bias, option, x_shape in [(True, False, (5, 8)), (False, True, (2, 3, 8)), (True, True, (4, 8)),
                                      (False, False, (3, 8))]:
            out_features = 4 * world
            full = ("linear", dict(in_features=8, out_features=out_features, bias=bias, seed=seed))
            x = inputs(x_shape, seed + 1)
            dy = inputs(x_shape[:-1] + (out_features,), seed + 2)
            label = f"{_groups_label(groups, world)}, bias={bias}, x of shape {x_shape}"
            if kind == "column":
                cases.append(dict(full=full, options=dict(gather_output=option), x=x, dy=dy, groups=groups,
                                  output="replicated" if option else "parallel",
                                  label=f"{label}, gather_output={option}"))
            else:
                cases.append(dict(full=full, options=dict(input_is_parallel=not option), x=x, dy=dy,
                                  groups=groups, input="replicated" if option else "parallel",
                                  label=f"{label}, input_is_parallel={not option}"))
            seed += 10
    return cases


def _refusal_cases(world, kind, seed):
    """Layouts the constructor must refuse: feature counts that N = world does not divide."""
    count = {2: 5, 4: 10}.get(world)
    if count is None:
        return []
    column = kind == "column"
    features = dict(in_features=8, out_features=count) if column else dict(in_features=count, out_features=6)
    options = dict(gather_output=False) if column else dict(input_is_parallel=True)
    label = f"{count} {'output' if column else 'input'} features on {world} ranks"
    return [dict(full=("linear", dict(features, seed=seed)), options=options, groups=None, refuse=True,
                 count=count, label=label)]


REFUSE_RULE = "when N does not divide the {} features, raise a ValueError that gives both numbers"


def _activation_bytes(case):
    return case["dy"].numel() * F64


def check_column_parallel_linear(ColumnParallelLinear):
    for world in WORLDS:
        cases = _layer_cases(world, "column", seed=30 + world) + _refusal_cases(world, "column", 30 + world)
        runs = run_module_cases(ColumnParallelLinear, world, cases, exercise="ColumnParallelLinear")
        for case, case_runs in zip(cases, runs, strict=True):
            if case.get("refuse"):
                expect_refusal(case_runs, f"ColumnParallelLinear of {case['label']}",
                               {"output features": case["count"], "ranks": world},
                               REFUSE_RULE.format("output"))
                continue
            gather = case["options"]["gather_output"]
            expect_module(case_runs, case, COLUMN, f"ColumnParallelLinear on {case['label']}",
                          forward=[(("all_gather", "all_gather_into_tensor"), None)] if gather else [],
                          backward=[("all_reduce", case["x"].numel() * F64)],
                          rule="f before the matmul: nothing forward, one all-reduce of x's gradient backward"
                               + ("; then one all-gather of the output slices forward" if gather else ""),
                          wrong=column_mistakes(case))


def check_row_parallel_linear(RowParallelLinear):
    for world in WORLDS:
        cases = _layer_cases(world, "row", seed=50 + world) + _refusal_cases(world, "row", 50 + world)
        runs = run_module_cases(RowParallelLinear, world, cases, exercise="RowParallelLinear")
        for case, case_runs in zip(cases, runs, strict=True):
            if case.get("refuse"):
                expect_refusal(case_runs, f"RowParallelLinear of {case['label']}",
                               {"input features": case["count"], "ranks": world},
                               REFUSE_RULE.format("input"))
                continue
            parallel = case["options"]["input_is_parallel"]
            expect_module(case_runs, case, ROW, f"RowParallelLinear on {case['label']}",
                          forward=[("all_reduce", _activation_bytes(case))],
                          backward=[] if parallel else [(("all_gather", "all_gather_into_tensor"), None)],
                          rule="g after the matmul: one all-reduce forward, nothing backward"
                               + ("" if parallel else "; and scatter_to_tp's all-gather backward"),
                          wrong=row_mistakes(case))


# --------------------------------------------------------------------------- 6-7. MLP and attention

def _block_cases(world, kind, seed):
    cases = []
    for groups in WORLDS[world]:
        for bias, shape in [(True, (2, 3, 8)), (False, (5, 8))] if kind == "mlp" else [(True, (2, 3, 8)),
                                                                                      (False, (1, 4, 8))]:
            full = (("mlp", dict(d_model=8, d_hidden=4 * world, bias=bias, seed=seed)) if kind == "mlp" else
                    ("attention", dict(d_model=8, n_heads=4, bias=bias, seed=seed)))
            cases.append(dict(full=full, x=inputs(shape, seed + 1), dy=inputs(shape, seed + 2), groups=groups,
                              label=f"{_groups_label(groups, world)}, bias={bias}, x of shape {shape}"))
            seed += 10
    return cases


ONE_EACH_WAY = "exactly one all-reduce forward (g) and one backward (f), of the block's input size"


def _head_refusals(world):
    """Attention layouts that must be refused: head counts that N = world does not divide."""
    heads = {2: 3, 4: 2}.get(world)
    if heads is None:
        return []
    return [dict(full=("attention", dict(d_model=2 * heads, n_heads=heads, seed=world)), groups=None,
                 refuse=True, heads=heads, label=f"{heads} heads on {world} ranks")]


def _check_block(cls, kind, layout, exercise):
    for world in WORLDS:
        cases = _block_cases(world, kind, seed=70 + world) + (_head_refusals(world) if kind == "attention"
                                                              else [])
        runs = run_module_cases(cls, world, cases, exercise=exercise)
        for case, case_runs in zip(cases, runs, strict=True):
            if case.get("refuse"):
                expect_refusal(case_runs, f"{exercise} of {case['label']}",
                               {"heads": case["heads"], "ranks": world},
                               "when N does not divide the number of heads, raise a ValueError that gives "
                               "both numbers")
                continue
            size = [("all_reduce", case["x"].numel() * F64)]
            expect_module(case_runs, case, layout, f"{exercise} on {case['label']}", forward=size,
                          backward=size, rule=ONE_EACH_WAY,
                          wrong=attention_mistakes(case) if kind == "attention" else None)
    for world, groups, bias in [(4, [[0, 2], [1, 3]], False)]:  # the visible test trains on [0, 1], [2, 3]
        full = (("mlp", dict(d_model=8, d_hidden=16, bias=bias, seed=90 + world)) if kind == "mlp" else
                ("attention", dict(d_model=8, n_heads=4, bias=bias, seed=90 + world)))
        shape = (4, 8) if kind == "mlp" else (2, 3, 8)
        case = dict(full=full, groups=groups, lr=0.2, label=f"training, {_groups_label(groups, world)}",
                    batches=[(inputs(shape, 200 + step), inputs(shape, 300 + step)) for step in range(4)])
        size = [("all_reduce", torch.Size(shape).numel() * F64)]
        expect_training(run_training(cls, world, case, exercise=exercise), case, layout,
                        f"{exercise}, 4 SGD steps on {_groups_label(groups, world)}, bias={bias}",
                        forward=size, backward=size, rule=ONE_EACH_WAY,
                        wrong=attention_mistakes if kind == "attention" else None)


def check_tensor_parallel_mlp(TensorParallelMLP):
    _check_block(TensorParallelMLP, "mlp", MLP, "TensorParallelMLP")


def check_tensor_parallel_attention(TensorParallelAttention):
    """(The visible part of the same test cell checks the ValueError for 6 heads on 4 ranks.)"""
    _check_block(TensorParallelAttention, "attention", ATTENTION, "TensorParallelAttention")
