"""Verdicts for tensor-parallel test cells: values against the unsharded float64 module, and collectives.

    runs = run_module_cases(ColumnParallelLinear, 2, cases, exercise="ColumnParallelLinear")
    for case, case_runs in zip(cases, runs):
        expect_module(case_runs, case, COLUMN, what="ColumnParallelLinear")

Why a module: a tensor-parallel layer is right when, on every rank, its output, the gradient
of its input and the gradient of each parameter slice are the matching pieces of what the
unsharded module computes -- and when each direction issues exactly the collectives the
design calls for, on the layer's own group. The reference here is the unsharded module run
in this process (float64, CPU), rebuilt from the case's seed; nothing comes from the ranks
but what the learner's code produced (docs/authoring.md rules 3 and 4).

Known mistakes have signatures, and the messages name them: an input gradient that is one
rank's partial product (f missing), an output that is one rank's partial sum (g missing), a
row-parallel output off by (N - 1) x bias (bias added on every rank), an all-reduce whose
group is the whole world, a weight slice that belongs to another rank.
"""

from contextlib import contextmanager

import torch

from dpcourse.checks.core import TOLERANCES, describe, missing_numbers, number, ratio_hint, wanted_numbers
from dpcourse.checks.tensors import (
    close,
    expect_collectives,
    expect_copies,
    expect_operator,
    expect_parameters_held,
    expect_tensor,
)
from dpcourse.comm.cases import members_of
from dpcourse.reference.shards import column_shard, row_shard, shard
from dpcourse.topics.tensor.runs import BUILDERS

LOSS = TOLERANCES["float64 absolute"][0]  # a loss against the float64 reference's, below 1 in absolute terms

# Where each parameter of a tensor-parallel module lives: "column" (rows of W, dim 0), "row"
# (columns of W, last dim) or "replicated" (every rank holds all of it).
COLUMN = {"weight": "column", "bias": "column"}
ROW = {"weight": "row", "bias": "replicated"}
MLP = {"fc1.weight": "column", "fc1.bias": "column", "fc2.weight": "row", "fc2.bias": "replicated"}
ATTENTION = {"qkv.weight": "column", "qkv.bias": "column", "proj.weight": "row", "proj.bias": "replicated"}


# --------------------------------------------------------------------------- collectives

# --------------------------------------------------------------------------- operators
# What each operator must do, written out from torch.distributed's semantics for every world rank
# of a case: outputs, input gradients, the collectives of each direction, and known wrong answers.

def _group_sum(tensors, members):
    return sum(tensors[m].double() for m in members)


def f_semantics(case, world_size):
    """copy_to_tp (f): output = x; gradient of x = the sum of the group's output gradients."""
    xs, dys = case["inputs"], case["grads"]
    out = {"outputs": [], "grads": [], "forward": [], "backward": [], "wrong_outputs": {}, "wrong_grads": {}}
    for rank in range(world_size):
        group = members_of(case.get("groups"), rank, world_size)
        total, n = _group_sum(dys, group), len(group)
        out["outputs"].append(xs[rank].double())
        out["grads"].append(total)
        out["forward"].append([])
        out["backward"].append([("all_reduce", dys[rank].numel() * dys[rank].element_size())])
        out["wrong_outputs"][rank] = [
            (_group_sum(xs, group), "f's forward is the identity: only the gradient is all-reduced")]
        out["wrong_grads"][rank] = [
            (dys[rank].double(), "it is this rank's own output gradient: backward must all-reduce it "
                                 "(sum over the group)"),
            (total / n, "averaged: f's backward sums the gradients, it does not divide by N"),
            (_group_sum(dys, range(world_size)), "summed over every rank of the world, not over the group")]
    return out


def g_semantics(case, world_size):
    """reduce_from_tp (g): output = the sum of the group's x; gradient of x = its output gradient."""
    xs, dys = case["inputs"], case["grads"]
    out = {"outputs": [], "grads": [], "forward": [], "backward": [], "wrong_outputs": {}, "wrong_grads": {}}
    for rank in range(world_size):
        group = members_of(case.get("groups"), rank, world_size)
        total, n = _group_sum(xs, group), len(group)
        out["outputs"].append(total)
        out["grads"].append(dys[rank].double())
        out["forward"].append([("all_reduce", xs[rank].numel() * xs[rank].element_size())])
        out["backward"].append([])
        out["wrong_outputs"][rank] = [
            (xs[rank].double(), "unchanged: g's forward must all-reduce x over the group"),
            (total / n, "averaged: g sums the partial results, it does not divide by N"),
            (_group_sum(xs, range(world_size)), "summed over every rank of the world, not over the group")]
        out["wrong_grads"][rank] = [
            (_group_sum(dys, group), "the sum of the group's gradients: g's backward is the identity -- the "
                                     "gradient of a replicated output is already the same on every rank")]
    return out


def gather_semantics(case, world_size):
    """gather_from_tp: output = the group's x side by side (last dimension, group-rank order);
    gradient of x = this rank's slice of its output gradient."""
    xs, dys = case["inputs"], case["grads"]
    out = {"outputs": [], "grads": [], "forward": [], "backward": [], "wrong_outputs": {}, "wrong_grads": {}}
    for rank in range(world_size):
        group = members_of(case.get("groups"), rank, world_size)
        index, n = group.index(rank), len(group)
        out["outputs"].append(torch.cat([xs[m].double() for m in group], dim=-1))
        mine = dys[rank].double().chunk(n, dim=-1)[index]
        out["grads"].append(mine)
        out["forward"].append([(("all_gather", "all_gather_into_tensor"), None)])
        out["backward"].append([])
        out["wrong_outputs"][rank] = [
            (torch.cat([xs[m].double() for m in reversed(group)], dim=-1),
             "the slices are in the wrong order: slice i comes from group rank i")]
        out["wrong_grads"][rank] = [
            (sum(dys[m].double().chunk(n, dim=-1)[index] for m in group),
             "summed over the group: the gathered output is replicated, its gradient is already the same "
             "on every rank -- just take this rank's slice (no communication)")]
    return out


# --------------------------------------------------------------------------- modules

def build_reference(case):
    """The unsharded module of a case, on the CPU in float64 (rebuilt from its seed)."""
    name, kwargs = case["full"]
    return BUILDERS[name](**dict(kwargs, device="cpu"))


def reference_of(case):
    """(full module, output, input gradient, {name: parameter gradient}) of one case, in one process."""
    full = build_reference(case)
    x = case["x"].double().clone().requires_grad_()
    y = full(x)
    y.backward(case["dy"].double())
    return full, y.detach(), x.grad, {n: p.grad for n, p in full.named_parameters()}


def expect_module(case_runs, case, layout, what, forward=None, backward=None, rule="", wrong=None):
    """Every rank of a module case: parameters held, output, input gradient and parameter gradients
    (values first: their mistakes have the most telling signatures), then the collectives of each
    direction. forward / backward: [(op, nbytes)] expected in each direction (None: not checked).

    wrong(rank, index, n, world, reference) -> {"output": [...], "input_grad": [...], name: [...]}:
    known mistakes to explain, where reference = (full module, output, input grad, parameter grads).
    """
    reference = reference_of(case)
    full, y, x_grad, param_grads = reference
    for run in case_runs:  # every rank's slices first: a wrong slice on one rank spoils its peers' values
        group = members_of(case.get("groups"), run.rank, len(case_runs))
        expect_parameters_held(run, full, layout, what, group)
        expect_copies(run, what)
    for run in case_runs:
        where = f"{what}: rank {run.rank}"
        group = members_of(case.get("groups"), run.rank, len(case_runs))
        index, n = group.index(run.rank), len(group)
        known = wrong(run.rank, index, n, len(case_runs), reference) if wrong else {}
        expected_y = shard(y, case.get("output", "replicated"), index, n)
        if isinstance(run.output, torch.Tensor) and run.output.shape != expected_y.shape:
            _explain_output_shape(run.output, expected_y, n, where)
        expect_tensor(run.output, expected_y, f"{where}'s output", known.get("output", ()))
        if run.no_grad:
            raise AssertionError(f"{where}'s output does not require grad: gradients cannot reach the "
                                 f"weights (computed under torch.no_grad(), or detached?)")
        if run.input_grad is None:
            raise AssertionError(f"{where}: no gradient reached the input x")
        expect_tensor(run.input_grad, shard(x_grad, case.get("input", "replicated"), index, n),
                      f"{where}'s gradient of the input x", known.get("input_grad", ()))
        for name, grad in param_grads.items():
            want = shard(grad, layout[name], index, n)
            got = run.grads.get(name)
            if got is None:
                raise AssertionError(f"{where}: {name} got no gradient (expected {describe(want, 4)})")
            expect_tensor(got, want, f"{where}'s gradient of {name} (its {layout[name]} slice)",
                          known.get(name, ()))
        if forward is not None:
            expect_collectives(run, run.forward, forward, what, "forward", group, rule)
        if backward is not None:
            expect_collectives(run, run.backward, backward, what, "backward", group, rule)


def _explain_output_shape(got, want, n, where):
    shapes = f"{where}'s output has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if n > 1 and got.shape[:-1] == want.shape[:-1]:
        if got.shape[-1] * n == want.shape[-1]:
            raise AssertionError(f"{shapes}: only this rank's slice -- the output must be gathered "
                                 f"(gather_output=True)")
        if got.shape[-1] == want.shape[-1] * n:
            raise AssertionError(f"{shapes}: the gathered output -- with gather_output=False each rank "
                                 f"returns its own slice")


def column_mistakes(case):
    """Known wrong answers of a column-parallel layer (for expect_module's `wrong`)."""
    dy = case["dy"].double()

    def wrong(rank, index, n, world, reference):
        full, _, x_grad, _ = reference
        partial = row_shard(dy, index, n) @ column_shard(full.weight.detach(), index, n)
        grads = [(partial, "it is this rank's partial gradient dy_r·W_r: the ranks' partial gradients of x "
                           "were not summed -- is f (copy_to_tp) missing?")]
        if world > n:  # every group holds the same slices: a sum over the world is world/n times too big
            grads.append((x_grad * (world // n), "summed over every rank of the world, not over the layer's "
                                                 "group: pass the group on to f"))
        grads += [(x_grad * n, f"{n} times the expected gradient: is f's all-reduce applied twice?"),
                  (x_grad / n, "1/N of the expected gradient: f sums, it does not average")]
        return {"input_grad": grads}
    return wrong


def row_mistakes(case):
    """Known wrong answers of a row-parallel layer (for expect_module's `wrong`)."""
    x = case["x"].double()

    def wrong(rank, index, n, world, reference):
        full, y, x_grad, _ = reference
        bias = full.bias.detach() if full.bias is not None else torch.zeros(())
        partial = row_shard(x, index, n) @ row_shard(full.weight.detach(), index, n).T
        output = [(partial + bias, "it is this rank's partial product x_r·W_rᵀ (+ b): the ranks' partial "
                                   "results were not summed -- is g (reduce_from_tp) missing?"),
                  (partial, "it is this rank's partial product x_r·W_rᵀ: is g (reduce_from_tp) missing?"),
                  (y * n, f"{n} times the expected output: all-reduced twice?")]
        if world > n:  # every group holds the same slices: the world's sum counts each partial world/n times
            output.append(((y - bias) * (world // n) + bias, "summed over every rank of the world, not over "
                                                             "the layer's group: pass the group on to g"))
        if full.bias is not None and n > 1:
            output.insert(0, (y + (n - 1) * bias, f"off by {n - 1} x bias: the bias was added on every rank "
                                                  f"before the all-reduce, which summed it {n} times; add it "
                                                  f"once, after g"))
        grads = []
        if case.get("input") != "parallel" and n > 1:
            own = torch.zeros_like(x_grad)
            start, stop = index * x.shape[-1] // n, (index + 1) * x.shape[-1] // n
            own[..., start:stop] = x_grad[..., start:stop]
            grads.append((own, "zero outside this rank's slice: cutting x with plain indexing sends no "
                               "gradient back for the other slices -- use scatter_to_tp, whose backward "
                               "all-gathers"))
        return {"output": output, "input_grad": grads}
    return wrong


def attention_mistakes(case):
    """Known wrong answers of an attention split by heads: every rank computing all n_heads heads on
    its slice of qkv, or n_heads / (the world's size) heads on a group smaller than the world (the
    heads then come out narrower or wider, and wrong)."""
    from dpcourse.topics.tensor.models import attend

    x = case["x"].double()

    def wrong(rank, index, n, world, reference):
        full = reference[0]
        heads = full.n_heads
        candidates = [(heads, f"each rank computed all {heads} heads on its slice of qkv: it holds only "
                              f"{heads} / {n} of them")]
        if world != n and heads % world == 0:
            candidates.append((heads // world, f"each rank computed {heads // world} head(s), n_heads / N "
                                               f"with N the world's {world} ranks: N is the size of the "
                                               f"group, dist.get_world_size(group) = {n}"))
        width = full.qkv.out_features // n
        outputs = []
        for local_heads, why in candidates:
            if n == 1 or width % (3 * local_heads):
                continue
            with torch.no_grad():
                qkv, weight = full.qkv(x), full.proj.weight
                y = sum(attend(row_shard(qkv, r, n), local_heads) @ row_shard(weight, r, n).T
                        for r in range(n))
                if full.proj.bias is not None:
                    y = y + full.proj.bias
            outputs.append((y, why))
        return {"output": outputs}
    return wrong


# --------------------------------------------------------------------------- training

def _first_output(case):
    """The unsharded module's output for the first training batch (before any update)."""
    with torch.no_grad():
        return build_reference(case)(case["batches"][0][0].double())


def reference_training(case):
    """(parameters before, after, losses) of the unsharded module trained like run_training does."""
    full = build_reference(case)
    before = {n: p.detach().clone() for n, p in full.named_parameters()}
    losses = []
    for x, target in case["batches"]:
        loss = ((full(x.double()) - target.double()) ** 2).mean()
        full.zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():
            for p in full.parameters():
                p -= case["lr"] * p.grad
        losses.append(loss.item())
    return before, {n: p.detach().clone() for n, p in full.named_parameters()}, losses


def expect_training(runs, case, layout, what, forward=None, backward=None, rule="", wrong=None):
    """After several SGD steps every rank holds the slices of the unsharded module trained the same
    way, every step's loss matches, and (if given) every step issued the expected collectives.

    Checked in the order that locates a mistake: the slices as built; the loss of step 0 (the forward,
    before any update; the first step's output is explained by `wrong`, a factory like
    attention_mistakes given the first batch as the case's x); the collectives of every step; the
    parameters after training, with the first step whose loss differs."""
    before, after, losses = reference_training(case)
    full = build_reference(case)
    for run in runs:
        group = members_of(case.get("groups"), run.rank, len(runs))
        if run.params_before:
            expect_parameters_held(run, full, layout, f"{what} (as built, before training)", group,
                                   params=run.params_before)
        expect_copies(run, what)
    first_output = _first_output(case)
    for run in runs:
        where = f"{what}: rank {run.rank}"
        group = members_of(case.get("groups"), run.rank, len(runs))
        index, n = group.index(run.rank), len(group)
        if run.losses and abs(run.losses[0] - losses[0]) > LOSS * max(1.0, abs(losses[0])):
            detail = ""
            if run.output is not None and wrong is not None:
                explain = wrong(dict(x=case["batches"][0][0]))
                reference = (full, first_output, None, None)
                known = explain(run.rank, index, n, len(runs), reference).get("output", ())
                detail = next((f" -- {why}" for candidate, why in known if close(run.output, candidate)), "")
            raise AssertionError(f"{where}: the loss of step 0, before any update, is "
                                 f"{number(run.losses[0])}, expected {number(losses[0])}: the forward "
                                 f"already differs from the unsharded module's{detail}")
        for step, (forward_ops, backward_ops) in enumerate(run.steps):
            if forward is not None:
                expect_collectives(run, forward_ops, forward, f"{what}, step {step}", "forward", group, rule)
            if backward is not None:
                expect_collectives(run, backward_ops, backward, f"{what}, step {step}", "backward", group,
                                   rule)
        if sorted(run.params) != sorted(after):
            raise AssertionError(f"{where}: the trained module has parameters {sorted(run.params)}, expected "
                                 f"{sorted(after)}")
        differ = next((step for step, (got, want) in enumerate(zip(run.losses, losses, strict=False))
                       if abs(got - want) > LOSS * max(1.0, abs(want))), None)
        context = (f" -- the losses of steps 0 to {differ - 1} agree, so the forward is right and the "
                   f"update of step {differ - 1} (its gradient) was not" if differ else
                   " -- the loss of every step agrees, so the forward is right and the gradient that moved "
                   "it is not")
        mismatches = []  # (rank of the explanation, message): a parameter that never moved explains the rest
        for name, full_after in after.items():
            got = run.params[name]
            want = shard(full_after, layout[name], index, n)
            start = shard(before[name], layout[name], index, n)
            if close(got, want):
                continue
            hint, order = "", 2
            if got.shape == start.shape and torch.equal(got.double(), start.double()):
                hint = " (it did not move at all: is it registered as a parameter, does it get a gradient?)"
                order = 0
            elif got.shape == want.shape and ratio_hint(got - start, want - start):
                hint, order = ratio_hint(got - start, want - start).replace("(", "(the update is ").replace(
                    "expected values", "expected update"), 1
            mismatches.append((order, f"{where}: after {len(losses)} SGD steps, {name} is "
                                      f"{describe(got, 4)}, expected its {layout[name]} slice of the "
                                      f"unsharded module's, {describe(want, 4)}{hint}{context}"))
        if mismatches:
            raise AssertionError(min(mismatches, key=lambda m: m[0])[1])
        for step, (got, want) in enumerate(zip(run.losses, losses, strict=True)):
            if abs(got - want) > LOSS * max(1.0, abs(want)):
                raise AssertionError(f"{where}: the loss of step {step} is {number(got)}, expected "
                                     f"{number(want)} (the unsharded module trained on the same batches)")


# --------------------------------------------------------------------------- layouts that cannot be split

def expect_refusal(case_runs, what, numbers, rule):
    """Every rank's constructor raised a ValueError whose message gives the numbers that do not divide.

    numbers: {what the number counts: value}, e.g. {"output features": 10, "ranks": 4}; the message must
    contain each value as a number of its own (not as part of another). rule: what the text asks for.
    """
    for run in case_runs:
        raised = run.refused
        if raised is None:
            raise AssertionError(f"{what}: rank {run.rank} built the module: expected a ValueError ({rule})")
        if not raised.startswith("ValueError"):
            raise AssertionError(f"{what}: rank {run.rank} raised {raised[:200].rstrip(': ')}: expected a "
                                 f"ValueError ({rule})")
        if missing_numbers(raised, numbers):
            raise AssertionError(f"{what}: rank {run.rank} raised {raised[:200]}: a ValueError, but its "
                                 f"message should say why, giving the numbers "
                                 f"{wanted_numbers(numbers)} ({rule})")


# --------------------------------------------------------------------------- blocks of earlier exercises

EXERCISES = {"copy_to_tp": 1, "reduce_from_tp": 2, "gather_from_tp": 3, "ColumnParallelLinear": 4,
             "RowParallelLinear": 5}


def _probe(name, learner):
    """The first line of what the visible basic test of an earlier exercise says about `learner`, or None
    when it passes (a launch of 2 ranks)."""
    from dpcourse.topics.tensor.models import inputs
    from dpcourse.topics.tensor.runs import run_module_cases, run_operator_cases

    try:
        if name in ("copy_to_tp", "reduce_from_tp", "gather_from_tp"):
            width = 2 if name == "gather_from_tp" else 4
            case = dict(inputs=[inputs((3, width), seed=r) for r in range(2)],
                        grads=[inputs((3, 4), seed=10 + r) for r in range(2)], groups=None, label="2 ranks")
            semantics = {"copy_to_tp": f_semantics, "reduce_from_tp": g_semantics,
                         "gather_from_tp": gather_semantics}[name]
            runs = run_operator_cases(learner, 2, [case], exercise=name)[0]
            expect_operator(runs, case, semantics(case, 2), name)
        else:
            column = name == "ColumnParallelLinear"
            case = dict(full=("linear", dict(in_features=8, out_features=12 if column else 6, seed=1)),
                        options=dict(gather_output=False) if column else dict(input_is_parallel=True),
                        x=inputs((5, 8), seed=2), dy=inputs((5, 12 if column else 6), seed=3),
                        groups=None, label="2 ranks", **({"output": "parallel"} if column else
                                                         {"input": "parallel"}))
            runs = run_module_cases(learner, 2, [case], exercise=name)[0]
            expect_module(runs, case, COLUMN if column else ROW, name,
                          forward=[] if column else [("all_reduce", 5 * 6 * 8)],
                          backward=[("all_reduce", 5 * 8 * 8)] if column else [])
    except Exception as problem:  # noqa: BLE001 - any failure of the earlier exercise is the news
        return f"{type(problem).__name__}: {problem}".split("\n")[0][:400]
    return None


@contextmanager
def built_on(block, **earlier):
    """Around a test of a block built from earlier exercises (the MLP from f, g and the two layers): when
    the test fails, run each earlier exercise's basic test and, if one fails, say so first -- a bug in f
    fails every cell after it, and the learner should fix the earliest exercise first.

        with built_on("TensorParallelMLP", copy_to_tp=copy_to_tp, ColumnParallelLinear=ColumnParallelLinear):
            ... the MLP's checks ...

    Costs nothing when the block's test passes (the probes only run after a failure).
    """
    try:
        yield
    except Exception as failure:
        for name, learner in earlier.items():
            problem = _probe(name, learner)
            if problem is not None:
                first = f"{type(failure).__name__}: {failure}".split("\n")[0][:300]
                raise AssertionError(f"{block} is built on your {name} (exercise {EXERCISES[name]}), which "
                                     f"fails its own test: fix {name} first. {name}: {problem}\n"
                                     f"({block}'s own failure: {first})") from None
        raise
