"""What the checks of tensor-valued exercises share: a tensor against its float64 reference, the collectives
one rank issued in one direction, a collective operator's forward and backward, the slices a rank holds.

    expect_tensor(run.output, expected, "rank 0's output", wrong=[(candidate, "g missing"), ...])
    expect_collectives(run, run.backward, [("all_reduce", 96)], "copy_to_tp", "backward", group)
    expect_operator(runs, case, f_semantics(case, 2), "copy_to_tp")

Used by the checks of notebooks 08 (tensor parallelism), 09 (hybrid) and 12 (sequence parallelism,
experts): here, below the topics, so that no chapter's checks import another's. Tolerances come
from the one table (checks.core.TOLERANCES): an exact algorithm agrees with the float64
reference to ~1e-15 ("float64 exact").
"""

import torch

from dpcourse.checks.core import TOLERANCES, describe, is_close, ratio_hint
from dpcourse.comm.cases import members_of
from dpcourse.reference.shards import locate_slices, shard

ATOL, RTOL = TOLERANCES["float64 exact"]  # an exact algorithm agrees to ~1e-15


def close(got, expected, kind="float64 exact"):
    """got is a tensor equal to expected within TOLERANCES[kind] (same shape, no NaN): the cheap test that
    runs before a mismatch's known mistakes are worked out."""
    return isinstance(got, torch.Tensor) and is_close(got, expected, *TOLERANCES[kind])


def expect_tensor(got, expected, what, wrong=()):
    """got must equal expected (float64 tolerance); `wrong` lists (tensor, explanation) of known
    mistakes: a result that matches one is explained by it."""
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{what} should be a tensor, got {describe(got)[:200]}")
    if got.shape != expected.shape:
        raise AssertionError(f"{what} has shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
    if close(got, expected):
        return
    _expect_dtype(got, expected, what)
    hint = next((f" -- {why}" for candidate, why in wrong if close(got, candidate)), "")
    if not hint:
        hint = ratio_hint(got, expected)
    raise AssertionError(f"{what} is {describe(got)}, expected {describe(expected)}{hint}")


def _expect_dtype(got, expected, what):
    """A result of the right values in a less precise dtype (an output buffer allocated with torch.empty's
    default, float32, for float64 inputs) prints like the expected one: name the dtype."""
    if got.dtype == expected.dtype or not (got.is_floating_point() and expected.is_floating_point()):
        return
    if is_close(got, expected):  # the looser tolerance of the two dtypes
        raise AssertionError(f"{what} has dtype {got.dtype}, expected {expected.dtype}: its values are right "
                             f"to {got.dtype}'s precision -- allocate outputs with the input's dtype "
                             f"(torch.empty(..., dtype=x.dtype); its default is {torch.get_default_dtype()})")


# --------------------------------------------------------------------------- collectives

def describe_ops(ops):
    """'no communication' or 'all_reduce of 96 bytes on ranks (0, 1), ...'."""
    if not ops:
        return "no communication"
    return ", ".join(f"{o.op} of {o.nbytes} bytes on ranks {o.group}" for o in ops)


def expect_collectives(run, ops, expected, what, direction, group, rule=""):
    """The collectives one rank issued in one direction: names, sizes (when given) and group.

    expected: [(op name or tuple of accepted names, nbytes or None), ...] in order; group: the world
    ranks of the rank's group. `rule` is appended to a count mismatch ("f: identity forward, one
    all-reduce of the gradient backward"). On a group of one rank, no communication is also fine.
    """
    accepted = [name if isinstance(name, tuple) else (name,) for name, _ in expected]
    if len(group) == 1 and not ops:
        return
    if len(ops) != len(accepted) or any(o.op not in names for o, names in zip(ops, accepted, strict=True)):
        wanted = "no communication" if not accepted else " then ".join(" or ".join(n) for n in accepted)
        raise AssertionError(f"{what}: rank {run.rank} issued {describe_ops(ops)} in {direction}, "
                             f"expected {wanted}" + (f" ({rule})" if rule else ""))
    for o, (_, nbytes) in zip(ops, expected, strict=True):
        if o.group is None or tuple(o.group) != tuple(group):
            whole = (" -- the whole world: pass the group on to every collective"
                     if o.group is not None and len(o.group) > len(group) else "")
            raise AssertionError(f"{what}: rank {run.rank}'s {o.op} in {direction} ran on ranks "
                                 f"{o.group}, expected its tensor-parallel group {tuple(group)}{whole}")
        if nbytes is not None and o.nbytes != nbytes:
            raise AssertionError(f"{what}: rank {run.rank}'s {o.op} in {direction} handed it {o.nbytes} "
                                 f"bytes, expected {nbytes}{_bytes_hint(o.nbytes, nbytes)}")


def _bytes_hint(got, expected):
    """Why a collective carried the wrong number of bytes, when the ratio says (a buffer's dtype)."""
    if 2 * got == expected:
        return (" -- half the bytes: a float32 buffer? torch.zeros(shape) and torch.empty(shape) are float32 "
                "unless given dtype=: make the buffer like the tensor (x.clone(), torch.empty_like(x))")
    if got == 2 * expected:
        return " -- twice the bytes: a float64 buffer for float32 values? make the buffer like the tensor"
    return ""


# --------------------------------------------------------------------------- operators

GRAD_IN_PLACE = ("all-reduce a copy (grad.clone()) -- the tensor autograd hands to backward may be the "
                 "caller's own")


def expect_operator(case_runs, case, expected, what, rule=""):
    """Each rank's output, input gradient and collectives against `expected` (one of the
    *_semantics of its chapter), and its input left unchanged (expected["input_in_place"] and
    ["grad_in_place"]: the advice when it is not, in the words of the operator's chapter)."""
    for run in case_runs:
        where = f"{what}: rank {run.rank}"
        group = members_of(case.get("groups"), run.rank, len(case_runs))
        expect_collectives(run, run.forward, expected["forward"][run.rank], what, "forward", group, rule)
        expect_tensor(run.output, expected["outputs"][run.rank], f"{where}'s output",
                      expected["wrong_outputs"].get(run.rank, ()))
        if not torch.equal(run.input_after, case["inputs"][run.rank].to(run.input_after.dtype)):
            raise AssertionError(f"{where} changed its input x in place (it is now "
                                 f"{describe(run.input_after)}, was {describe(case['inputs'][run.rank])}): "
                                 + expected.get("input_in_place", "all-reduce a copy (x.clone()): the caller "
                                                                  "still needs x"))
        if run.no_grad:
            raise AssertionError(f"{where}'s output does not require grad: return the result of your "
                                 f"autograd.Function (YourFunction.apply(x, group)) so backward can reach x")
        expect_collectives(run, run.backward, expected["backward"][run.rank], what, "backward", group, rule)
        if run.grad_after is not None:
            raise AssertionError(f"{where}'s backward changed the gradient it was handed, in place (the "
                                 f"caller's tensor is now {describe(run.grad_after)}, was "
                                 f"{describe(case['grads'][run.rank])}): "
                                 + expected.get("grad_in_place", GRAD_IN_PLACE))
        if run.input_grad is None:
            raise AssertionError(f"{where}: no gradient reached x: backward must return a gradient for x "
                                 f"(and None for the group)")
        expect_tensor(run.input_grad, expected["grads"][run.rank], f"{where}'s gradient of x",
                      expected["wrong_grads"].get(run.rank, ()))


# --------------------------------------------------------------------------- parameter slices

def expect_copies(run, what):
    """No parameter shares memory with the unsharded module's (a view keeps the whole weight on every
    rank, and an update of the slice writes into the unsharded module)."""
    for name, (kept, own) in sorted(run.views.items()):
        keeps = f"it keeps all {kept} values of the full tensor alive for its {own}, and " if kept > own \
            else ""
        raise AssertionError(f"{what}: rank {run.rank}'s {name} is a view of the unsharded module's "
                             f"parameter, not a copy: {keeps}every update of it writes into the unsharded "
                             f"module -- keep a copy, e.g. nn.Parameter(linear.weight.detach()[a:b].clone())")


def expect_parameters_held(run, full, layout, what, group, params=None):
    """The module's parameters are the rank's slices of the full ones, named like the reference's
    (params: what to check instead of run.params, e.g. the parameters as built, before training)."""
    expected = {n: layout[n] for n, _ in full.named_parameters()}
    index, n = group.index(run.rank), len(group)
    params = run.params if params is None else params
    if sorted(params) != sorted(expected):
        extra = sorted(set(params) - set(expected))
        missing = sorted(set(expected) - set(params))
        hint = ""
        if extra:
            hint = (" -- keep only your slices as parameters (a full layer stored as an attribute is "
                    "a submodule, and its full weight a parameter)")
        elif missing:
            hint = (" -- build the layers in __init__ and assign them as attributes named like the "
                    "reference's (a plain list hides them from .parameters())")
        raise AssertionError(f"{what}: rank {run.rank}'s module has parameters {sorted(params)}, "
                             f"expected {sorted(expected)}{hint}")
    for name, p in full.named_parameters():
        want = shard(p.detach(), expected[name], index, n)
        got = params[name]
        if got.shape == want.shape and torch.equal(got.double(), want.double()):
            continue
        dim = 0 if expected[name] == "column" else -1
        held = locate_slices(got, p.detach(), dim) if expected[name] != "replicated" else None
        hint = ""
        if held is not None:
            hint = f" -- it holds {'rows' if dim == 0 else 'columns'} {_ranges(held)} of the full {name}"
            owner = _owner(held, p.shape[dim], n)
            if owner is not None and owner != index:
                hint += (f", the slice of group rank {owner}; rank {run.rank} is rank {index} of its group "
                         f"{group}: dist.get_rank(group), not the world rank")
        elif got.dim() == 2 and got.shape == want.shape[::-1]:
            hint = " -- transposed: nn.Linear's weight is (out_features, in_features)"
        elif got.dim() == want.dim() and got.shape[dim] == 0:
            hint = (" -- an empty slice, beyond the end of the weight: is the slice index the world rank "
                    "(dist.get_rank()) instead of the rank in the group (dist.get_rank(group))?")
        raise AssertionError(f"{what}: rank {run.rank} (rank {index} of {n} in its group) holds {name} of "
                             f"shape {tuple(got.shape)} = {describe(got, 4)}, expected its {expected[name]} "
                             f"slice, of shape {tuple(want.shape)} = {describe(want, 4)}{hint}")


def _ranges(indices):
    return (f"{indices[0]}-{indices[-1]}" if indices == list(range(indices[0], indices[-1] + 1))
            else str(indices))


def _owner(indices, size, world_size):
    step = size // world_size
    owners = {i // step for i in indices}
    return owners.pop() if len(owners) == 1 and len(indices) == step else None
