"""Verdicts for notebook 09's test cells: grids against init_device_mesh's layout, training against one
process.

    expect_grid(run_grid_cases(make_grid_groups, 4, [case])[0], case, "make_grid_groups(2, 2)")
    expect_dp_tp(run_dp_tp_cases(hybrid_dp_tp_step, [case])[0], case, "hybrid_dp_tp_step on 2 x 2")

Why a module: each exercise is right when three things hold, and the messages say which did not.
  * Grids: every rank created the same groups in the same order (else gloo hangs), and each
    rank's coordinates and groups are those of `torch.arange(world).view(dp, pp, tp)`, the layout
    init_device_mesh builds (the group along an axis is the line of that array through the rank,
    as DeviceMesh cuts it: the array with that axis moved last, reshaped to rows of its size).
    A layout with dp and tp swapped has a signature, and is named.
  * Training: after every step, every rank's losses and parameters (its tensor-parallel slices,
    or its stage's layers) equal those of one float64 process training the unsharded model on
    the same global batches (`reference_training`), within 1e-9.
  * Communication: every collective ran on one of the rank's own groups and every message went
    to a neighbour in its own pipeline; per step, the bytes it sent on each group are the
    formulas of `traffic` (tp: the model's own activation all-reduces and nothing more; dp: each
    gradient once; pp: one activation and one gradient per micro-batch and neighbour).
Expected values are computed here, in the test cell, from the case alone (docs/authoring.md rule 3).
"""

import math

import torch

from dpcourse.checks.core import TOLERANCES, describe, number, ratio_hint
from dpcourse.checks.tensors import close
from dpcourse.comm.volume import ring_bytes
from dpcourse.reference.shards import shard
from dpcourse.topics.hybrid.grid import AXES, expected_grid
from dpcourse.topics.hybrid.models import dp_pp_model, dp_tp_model, placement
from dpcourse.topics.hybrid.runs import ORDER_RULE
from dpcourse.topics.hybrid.traffic import dp_pp_bytes, dp_tp_bytes
from dpcourse.toys.models import loss_fn as mse_loss

ATOL, RTOL = TOLERANCES[torch.float64]  # float64, a few steps
SCALAR = TOLERANCES["float64 scalar"]  # a loss or a prediction against its formula

# --------------------------------------------------------------------------- grids


def _grid_of(mesh):
    """Per rank {"coords", "members"} of a [d, p, t]-indexed array of ranks (every line through a rank)."""
    out = []
    for rank in range(mesh.numel()):
        d, p, t = (int(i) for i in (mesh == rank).nonzero()[0])
        members = {"dp": sorted(mesh[:, p, t].tolist()), "pp": sorted(mesh[d, :, t].tolist()),
                   "tp": sorted(mesh[d, p, :].tolist())}
        out.append({"coords": {"dp": d, "pp": p, "tp": t}, "members": members})
    return out


RANK_RULE = ("in init_device_mesh's layout the last axis, tp, varies fastest, then pp, then dp -- "
             "rank = (d·pp + p)·tp + t, so ranks r and r + 1 share a tp group (neighbours inside a node)")
SWAPPED = f"dp and tp are swapped: {RANK_RULE}"
ORDER_NAMES = {("tp", "pp", "dp"): SWAPPED,
               ("dp", "tp", "pp"): f"pp and tp are swapped (pp varies fastest): {RANK_RULE}",
               ("pp", "dp", "tp"): f"dp and pp are swapped (pp varies slowest): {RANK_RULE}"}


def known_grids(dp, tp, pp):
    """[(why, per-rank grid)] of the layouts a grid is known to be built wrong in: the axes laid out in
    another order (dp and tp swapped, pp and tp, dp and pp, or rotated), and dp groups that also span
    the pipeline (the ranks sharing this rank's tp coordinate, whatever their stage)."""
    sizes = {"dp": dp, "pp": pp, "tp": tp}
    out = []
    for order in (("tp", "pp", "dp"), ("dp", "tp", "pp"), ("pp", "dp", "tp"), ("pp", "tp", "dp"),
                  ("tp", "dp", "pp")):
        mesh = torch.arange(dp * pp * tp).view(*(sizes[a] for a in order)).permute(
            *(order.index(a) for a in AXES))
        why = ORDER_NAMES.get(order, f"the axes are laid out as {', '.join(order)} (slowest to fastest): "
                                     f"{RANK_RULE}")
        out.append((why, _grid_of(mesh)))
    spanning = _grid_of(torch.arange(dp * pp * tp).view(dp, pp, tp))
    for entry in spanning:
        entry["members"]["dp"] = sorted(r for r in range(dp * pp * tp) if r % tp == entry["coords"]["tp"])
    out.append(("the dp group spans the pipeline stages too: a dp group holds one rank of each replica for "
                "one stage and one tp slice -- the ranks with this rank's pp and tp coordinates, "
                "mesh[:, p, t]", spanning))
    return out


def _known_mistake(reports, expected, known, part, axis=None):
    """' -- why' of the first known layout that every rank's reported coordinates (part="coords") or
    members along `axis` (part="members") follow, where they differ from init_device_mesh's."""
    def of(entry):
        return entry["coords"] if part == "coords" else entry["members"][axis]

    if part == "members" and any(isinstance(report["members"][axis], str) for report in reports):
        return ""  # a rank without a group along the axis: its own message says so
    got = [report["coords"] if part == "coords" else sorted(report["members"][axis]) for report in reports]
    for why, grid in known:
        if all(of(g) == mine for g, mine in zip(grid, got, strict=True)) and \
                any(of(g) != of(e) for g, e in zip(grid, expected, strict=True)):
            return f" -- {why}"
    return ""


def expect_group_order(reports, what):
    """Every rank created the same groups (member lists) in the same order."""
    created = [r.get("created") or [] for r in reports]
    first = created[0]
    for rank, mine in enumerate(created[1:], start=1):
        if mine == first:
            continue
        if len(mine) != len(first):
            few, many = (rank, 0) if len(mine) < len(first) else (0, rank)
            raise AssertionError(
                f"{what}: rank {few} created {len(created[few])} group(s), rank {many} created "
                f"{len(created[many])}: {ORDER_RULE} -- every rank calls dist.new_group for every group of "
                f"every axis, also the groups it is not a member of (rank 0 created {first[:6]}, rank "
                f"{rank} created {mine[:6]})")
        k = next(i for i, (a, b) in enumerate(zip(first, mine, strict=True)) if a != b)
        raise AssertionError(
            f"{what}: rank 0's group number {k + 1} has members {first[k]}, rank {rank}'s has {mine[k]}: "
            f"{ORDER_RULE} (dist.new_group is collective: each call is matched with the same call on "
            f"every other rank)")


def expect_grid(reports, case, what):
    """A learner's grid on every rank: no error, same group order, sizes, coordinates, members."""
    dp, tp, pp = case["dp"], case["tp"], case.get("pp", 1)
    for report in reports:
        error = report.get("error")
        if error and error.startswith("GroupOrderError"):
            raise AssertionError(f"{what}: {error.split(': ', 1)[1]}")
    expect_group_order(reports, what)
    for rank, report in enumerate(reports):
        if report.get("error"):
            raise AssertionError(f"{what} raised on rank {rank}: {report['error']}")
    expected, known = expected_grid(dp, tp, pp), known_grids(dp, tp, pp)
    sizes = {"dp": dp, "pp": pp, "tp": tp}
    for rank, report in enumerate(reports):
        if report["sizes"] != sizes:
            raise AssertionError(f"{what}: rank {rank}'s grid.sizes is {report['sizes']}, expected {sizes}")
        for axis in AXES:
            members = report["members"][axis]
            if members in ("None", "missing"):
                size = sizes[axis]
                alone = (f" -- the {axis} axis has size {size} here, and still needs a process group: a "
                         f"group of one rank, made with dist.new_group like the others (every rank "
                         f"creates it)") if size == 1 else ""
                raise AssertionError(f"{what}: rank {rank}'s grid.groups['{axis}'] is "
                                     f"{'None' if members == 'None' else 'missing'}: every axis needs this "
                                     f"rank's process group along it{alone}")
            if isinstance(members, str):
                raise AssertionError(f"{what}: rank {rank}'s grid.groups['{axis}'] is {members}")
        want = expected[rank]
        got_members = {axis: sorted(report["members"][axis]) for axis in AXES}
        if report["coords"] != want["coords"]:
            hint = _known_mistake(reports, expected, known, "coords")
            raise AssertionError(f"{what}: rank {rank}'s coordinates are {report['coords']}, expected "
                                 f"{want['coords']} (its place in torch.arange({dp * pp * tp})"
                                 f".view({dp}, {pp}, {tp})){hint}")
        if got_members != want["members"]:
            axis = next(a for a in AXES if got_members[a] != want["members"][a])
            hint = _known_mistake(reports, expected, known, "members", axis)
            raise AssertionError(f"{what}: rank {rank}'s {axis} group has members {report['members'][axis]}, "
                                 f"expected {want['members'][axis]} (init_device_mesh(..., ({dp}, {pp}, "
                                 f"{tp}), "
                                 f"mesh_dim_names=('dp', 'pp', 'tp'))['{axis}'] on rank {rank}){hint}")


def expect_bad_sizes_refused(reports, what, case=None):
    """Every rank raised a ValueError (a grid whose size is not the world's, larger or smaller)."""
    world = len(reports)
    why = ""
    if case is not None:
        size = case["dp"] * case.get("pp", 1) * case["tp"]
        if size < world:
            why = (f" -- dp x pp x tp = {size} is smaller than the world size {world}: ranks {size} .. "
                   f"{world - 1} would have no place in the grid. Refuse a grid whose size differs from the "
                   f"world's in either direction")
        elif size > world:
            why = f" -- dp x pp x tp = {size} is larger than the world size {world}"
    for rank, report in enumerate(reports):
        error = report.get("error") or ""
        if not error.startswith("ValueError"):
            got = f"raised {error[:200]}" if error else "returned a grid"
            raise AssertionError(f"{what}: rank {rank} {got}; expected a ValueError saying that dp x pp x tp "
                                 f"is not the world size{why}")


# --------------------------------------------------------------------------- training


def reference_training(model, batches, lr, dp):
    """One float64 process: per step, the loss of each replica's rows (before the update), and
    the parameters after SGD on the whole batch's mean loss."""
    params = dict(model.named_parameters())
    out = {"losses": [], "params": []}
    for x, y in batches:
        with torch.no_grad():
            out["losses"].append([mse_loss(model(xd), yd).item()
                                  for xd, yd in zip(x.tensor_split(dp), y.tensor_split(dp), strict=True)])
            whole = mse_loss(model(x), y).item()
        out.setdefault("whole", []).append(whole)
        loss = mse_loss(model(x), y)
        grads = torch.autograd.grad(loss, list(params.values()))
        with torch.no_grad():
            for p, g in zip(params.values(), grads, strict=True):
                p -= lr * g
        out["params"].append({n: p.detach().clone() for n, p in params.items()})
    return out


def _fail_report(case_runs, what, describe_rank=None, where=None):
    """A step raised on some rank: name the first rank that raised of its own accord (not one that
    only waited for a peer); for a pure wait, describe_rank(run) says where each rank was."""
    failed = [r for r in case_runs if r.error]
    if not failed:
        return
    first = ([r for r in failed if not getattr(r, "waited", False)] or failed)[0]
    lines = ""
    if describe_rank is not None and all(getattr(r, "waited", False) for r in failed):
        lines = "\n" + "\n".join(f"  {describe_rank(r)}" for r in case_runs)
    context = f" ({where(first.rank)})" if where is not None else ""
    raise AssertionError(f"{what}: rank {first.rank}{context} raised in step {first.failed_step + 1}: "
                         f"{first.error}{lines}")


def _group_label(group):
    return tuple(group) if group else None


def _expect_groups(case_runs, members, what, allowed_axes, p2p_axis=None):
    """Every collective on one of the rank's groups along allowed_axes; every message to its pipeline."""
    for run in case_runs:
        mine = members[run.rank]
        groups = {axis: tuple(mine[axis]) for axis in allowed_axes}
        for step, ops in enumerate(run.steps):
            for o in ops:
                if o.op in ("send", "recv"):
                    _expect_neighbour(run, step, o, tuple(mine[p2p_axis]) if p2p_axis else (), what)
                    continue
                if _group_label(o.group) in groups.values():
                    continue
                names = ", ".join(f"{a} {g}" for a, g in groups.items())
                world = " -- the whole world: pass the group (grid.groups[...]) to every collective" if (
                    o.group and len(o.group) == len(case_runs)) else ""
                other = next((a for a in mine if a not in allowed_axes and len(mine[a]) > 1
                              and _group_label(o.group) == tuple(mine[a])), None)
                if other and not world:
                    world = (f" -- that is its {other} group: the ranks of a pipeline hold different stages, "
                             "their gradients are not to be summed; average each stage's gradients over the "
                             "dp group only")
                raise AssertionError(f"{what}: in step {step + 1} rank {run.rank}'s {o.op} of {o.nbytes} "
                                     "bytes "
                                     f"ran on ranks {_group_label(o.group)}, outside its groups "
                                     f"({names}){world}")


def _expect_neighbour(run, step, o, pipeline, what):
    peer = o.world_peer
    if peer in pipeline and peer != run.rank:
        return
    verb = "sent to" if o.op == "send" else "received from"
    raise AssertionError(f"{what}: in step {step + 1} rank {run.rank} {verb} rank {peer}, outside its "
                         "pipeline "
                         f"{pipeline} (its pp group): a stage's neighbours are world ranks of its own "
                         "replica -- "
                         f"build the stage with ranks=grid.members('pp') and index grid.coords['pp']")


def _sent_on(ops, group):
    """Bytes a rank sent on `group` (collectives as rings, sends as themselves)."""
    total = 0.0
    for o in ops:
        if o.op == "send" or _group_label(o.group) == tuple(group):
            if o.op == "send" or len(group) > 1:
                total += ring_bytes(o)
    return total


def _multiple_of(extra, previous):
    """c > 0.5 when `extra` is c times `previous` (a previous update added in again), else 0."""
    previous, extra = previous.double().flatten(), extra.double().flatten()
    norm = float(previous @ previous)
    if norm < 1e-24:
        return 0.0
    c = float(extra @ previous) / norm
    return c if c > 0.5 and (extra - c * previous).norm() <= 1e-6 * extra.norm() else 0.0


def _expect_param(got, expected, before, previous_update, where):
    """got == expected; else explain with the update's signature (its ratio to the right update,
    no update at all, or the previous step's update added in again)."""
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{where} is missing")
    if got.shape != expected.shape:
        raise AssertionError(f"{where} has shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
    if close(got, expected, torch.float64):
        return
    update, right = got.double() - before.double(), expected.double() - before.double()
    hint = ratio_hint(update, right)
    if close(update, torch.zeros_like(right), torch.float64):
        hint = " -- it did not change: was the update applied (p -= lr * grad, under torch.no_grad())?"
    elif previous_update is not None and _multiple_of(update - right, previous_update):
        hint = (" -- the previous step's gradient was added in again: gradients accumulate in .grad, so "
                "clear them after each update (p.grad = None)")
    elif hint:
        hint = (f" -- the update is {hint.strip()[1:-1]}: average the gradients over the dp group (sum, then "
                f"divide by dp)")
    raise AssertionError(f"{where} is {describe(got)}, expected {describe(expected)}{hint}")


def _expect_loss(run, step, expected_losses, whole, replica, what):
    got = run.losses[step] if step < len(run.losses) else None
    want = expected_losses[replica]
    if isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=SCALAR[1], abs_tol=SCALAR[0]):
        return
    hint = ""
    if isinstance(got, (int, float)):
        other = [d for d, v in enumerate(expected_losses)
                 if math.isclose(got, v, rel_tol=SCALAR[1], abs_tol=SCALAR[0])]
        if other:
            hint = (f" -- that is the loss of replica {other[0]}'s rows: rank {run.rank} is in replica "
                    f"{replica} "
                    f"(grid.coords['dp']); slice the batch by the dp coordinate, not by the world rank")
        elif math.isclose(got, whole, rel_tol=SCALAR[1]):
            hint = (f" -- that is the loss of the whole batch: each replica trains on its "
                    f"1/{len(expected_losses)} of the rows")
    raise AssertionError(f"{what}: rank {run.rank}'s loss in step {step + 1} is {number(got)}, expected "
                         f"{number(want)}, "
                         f"the loss of replica {replica}'s rows (batch.tensor_split(dp)[{replica}], the "
                         "same rows "
                         f"on every rank of the replica){hint}")


def _expect_float_losses(case_runs, what):
    """The step returns the replica's loss as a Python float, never the loss tensor."""
    for run in case_runs:
        for step, kind in enumerate(run.loss_types):
            if kind != "float":
                raise AssertionError(
                    f"{what}: rank {run.rank}'s step {step + 1} returned {kind}; expected a Python float, "
                    f"this replica's loss: return loss.item() (the loss tensor keeps the step's autograd "
                    f"graph alive)")


def _expect_no_scalar(run, step, ops, group, what):
    """A collective of one value on the dp group: the loss all-reduced, not a gradient."""
    for o in ops:
        if o.op != "send" and _group_label(o.group) == tuple(group) and 0 < o.nbytes <= 8:
            raise AssertionError(
                f"{what}: in step {step + 1} rank {run.rank} ran {o.op} of {o.nbytes} bytes -- a single "
                f"value, the loss? -- on its dp group {tuple(group)}: the step returns this replica's own "
                f"loss, and its only communication is the gradients' all-reduces over dp")


def dp_tp_reference(case):
    return reference_training(dp_tp_model(**case["model"]), case["batches"], case["lr"], case["grid"][0])


def expect_dp_tp(case_runs, case, what):
    """hybrid_dp_tp_step on a (dp, tp) grid: errors, groups, bytes per group, losses, parameters."""
    dp, tp = case["grid"]
    grid = expected_grid(dp, tp)
    members = {r: g["members"] for r, g in enumerate(grid)}
    _fail_report(case_runs, what)
    _expect_float_losses(case_runs, what)
    _expect_groups(case_runs, members, what, ("tp", "dp"))
    rows = len(case["batches"][0][0])
    formula = dp_tp_bytes(case["model"], rows, dp, tp)
    for run in case_runs:
        tp_group, dp_group = members[run.rank]["tp"], members[run.rank]["dp"]
        for step, ops in enumerate(run.steps):
            tp_sent = _sent_on(ops, tp_group) if tp_group != dp_group else None
            if tp_sent is not None and tp_sent > formula["tp"] + 0.5:
                raise AssertionError(
                    f"{what}: in step {step + 1} rank {run.rank} sent {tp_sent:.0f} bytes on its tp group "
                    f"{tuple(tp_group)}, but the model's own all-reduces (g forward, f backward, one each "
                    "per "
                    f"block) send {formula['tp']:.0f}: parameter gradients are not all-reduced over tp -- "
                    "each tp rank holds a different slice of the split layers, and already the same, "
                    "complete "
                    f"gradient of the replicated ones (f and g made it so); average over the dp group only")
            dp_sent = _sent_on(ops, dp_group)
            if abs(dp_sent - formula["dp"]) > 0.5:
                n = len(dp_group)
                _expect_no_scalar(run, step, ops, dp_group, what)
                raise AssertionError(
                    f"{what}: in step {step + 1} rank {run.rank} sent {dp_sent:.0f} bytes on its dp group "
                    f"{tuple(dp_group)}, expected {formula['dp']:.0f}: every local gradient all-reduced "
                    "once over "
                    f"the dp group, 2(dp - 1)/dp = {2 * (n - 1)}/{n} of its bytes per rank")
    _expect_values(case_runs, case, what, dp_tp_reference(case), grid,
                   local=lambda name, full, coords: shard(full, placement(name), coords["tp"], tp))


def _expect_values(case_runs, case, what, reference, grid, local, last_only=None):
    """Step by step: every rank's loss (a wrong slice of the batch shows there), then every rank's
    parameters after the step, against the one-process reference."""
    history = [_initial_parameters(case)] + reference["params"]  # history[k]: before step k + 1
    for step in range(len(case["batches"])):
        for run in case_runs:
            coords = grid[run.rank]["coords"]
            if last_only is None or last_only(run.rank):
                _expect_loss(run, step, reference["losses"][step], reference["whole"][step], coords["dp"],
                             what)
            elif step < len(run.losses) and run.losses[step] is not None:
                raise AssertionError(f"{what}: rank {run.rank} (pipeline stage {coords['pp']}) returned "
                                     f"{run.losses[step]!r} in step {step + 1}; only the last stage has a "
                                     "loss: "
                                     f"return None elsewhere")
        for run in case_runs:
            coords = grid[run.rank]["coords"]
            got = run.params[step] if step < len(run.params) else {}
            for name, full in reference["params"][step].items():
                want = local(name, full, coords)
                if want is None:
                    continue
                before = local(name, history[step][name], coords)
                previous = (before - local(name, history[step - 1][name], coords)) if step else None
                _expect_param(got.get(name), want, before, previous,
                              f"{what}: rank {run.rank}'s {name} after step {step + 1}")


def _initial_parameters(case):
    model = dp_tp_model(**case["model"]) if "cuts" not in case else dp_pp_model(**case["model"])
    return {n: p.detach() for n, p in model.named_parameters()}


# --------------------------------------------------------------------------- data x pipeline


def _stage_of(case, rank):
    dp, pp = case["grid"]
    return expected_grid(dp, 1, pp)[rank]["coords"]["pp"]


def _stage_names(case, stage):
    cuts = case["cuts"]
    model = dp_pp_model(**case["model"])
    return {f"{i}.{n}" for i in range(cuts[stage], cuts[stage + 1]) for n, _ in model[i].named_parameters()}


def dp_pp_reference(case):
    return reference_training(dp_pp_model(**case["model"]), case["batches"], case["lr"], case["grid"][0])


def expect_dp_pp(case_runs, case, what):
    """hybrid_dp_pp_step on a (dp, pp) grid: errors, peers and groups, bytes, losses, parameters."""
    dp, pp = case["grid"]
    grid = expected_grid(dp, 1, pp)
    members = {r: g["members"] for r, g in enumerate(grid)}

    def blocked(run):
        ops = [o for ops in run.steps for o in ops]
        last = ops[-1] if ops else None
        where = f"{last.op} {'to' if last.op == 'send' else 'from'} rank {last.world_peer}" if last and \
            last.op in ("send", "recv") else (last.op if last else "before any message")
        pipeline = members[run.rank]["pp"]
        stray = next((o for o in ops if o.op in ("send", "recv") and o.world_peer not in pipeline),
                     None)
        extra = (f"; it {'sent to' if stray.op == 'send' else 'received from'} rank {stray.world_peer}, "
                 "outside its "
                 f"pipeline {tuple(members[run.rank]['pp'])}") if stray else ""
        return f"rank {run.rank} (replica {grid[run.rank]['coords']['dp']}, stage " \
               f"{grid[run.rank]['coords']['pp']}): last call {where}{extra}"

    for run in case_runs:  # a message outside the pipeline explains a deadlock best
        for step, ops in enumerate(run.steps):
            for o in ops:
                if o.op in ("send", "recv"):
                    _expect_neighbour(run, step, o, tuple(members[run.rank]["pp"]), what)

    def where(rank):
        place = grid[rank]
        return (f"stage {place['coords']['pp']} of replica {place['coords']['dp']}, whose pipeline is ranks "
                f"{tuple(place['members']['pp'])}: make_stage(model, cuts, grid.coords['pp'], "
                f"ranks=grid.members('pp'))")

    _fail_report(case_runs, what, blocked, where)
    _expect_groups(case_runs, members, what, ("dp",), p2p_axis="pp")
    rows = len(case["batches"][0][0])
    width = case["model"].get("width", 6)
    for run in case_runs:
        stage = grid[run.rank]["coords"]["pp"]
        n_params = sum(t.numel() for n, t in dp_pp_model(**case["model"]).named_parameters()
                       if n in _stage_names(case, stage))
        formula = dp_pp_bytes(width, n_params, rows, dp, pp, case["n_micro"], stage)
        for step, ops in enumerate(run.steps):
            sent = sum(o.nbytes for o in ops if o.op == "send")
            if abs(sent - formula["pp"]) > 0.5:
                raise AssertionError(
                    f"{what}: in step {step + 1} rank {run.rank} (stage {stage}) sent {sent} bytes to its "
                    f"pipeline neighbours, expected {formula['pp']}: per micro-batch one activation forward "
                    "and "
                    f"one gradient back, {rows // dp // case['n_micro']} rows x {width} values each")
            dp_sent = _sent_on([o for o in ops if o.op != "send"], members[run.rank]["dp"])
            if abs(dp_sent - formula["dp"]) > 0.5:
                n = dp
                raise AssertionError(
                    f"{what}: in step {step + 1} rank {run.rank} (stage {stage}) sent {dp_sent:.0f} bytes "
                    "on its dp "
                    f"group {tuple(members[run.rank]['dp'])}, expected {formula['dp']:.0f}: each of its "
                    "stage's "
                    f"{n_params} gradients all-reduced once over the dp group, 2(dp - 1)/dp = "
                    f"{2 * (n - 1)}/{n} "
                    f"of their bytes per rank")

    def local(name, full, coords):
        return full if name in _stage_names(case, coords["pp"]) else None

    _expect_values(case_runs, case, what, dp_pp_reference(case), grid, local,
                   last_only=lambda rank: _stage_of(case, rank) == pp - 1)
    initial = dict(dp_pp_model(**case["model"]).named_parameters())
    for run in case_runs:
        mine = _stage_names(case, _stage_of(case, run.rank))
        for name, value in (run.params[-1] if run.params else {}).items():
            if name not in mine and not torch.equal(value, initial[name].detach()):
                raise AssertionError(f"{what}: rank {run.rank} changed {name}, a parameter of another stage: "
                                     f"update only your stage's layers")


# --------------------------------------------------------------------------- the planner

PLAN_KEYS = ("dp", "tp", "pp", "micro", "time", "memory")


def expect_plan(outcome, model, cluster, best, what):
    """plan's answer: a valid layout that fits, whose time and memory are predict's, and whose time is
    the best's (`best`: a layout known to be fastest, e.g. found by trying every layout)."""
    from dpcourse.topics.hybrid.costs import predict

    if "error" in outcome:
        fits = ""
        if outcome["error"] == "ValueError":
            known = predict(model, cluster, **best)
            fits = (f"; but {best} fits ({known['memory'] / 1e9:.2f} GB per GPU of "
                    f"{cluster['memory'] / 1e9:g} GB): try every dp, tp, pp and micro-batch count")
        raise AssertionError(f"{what} raised {outcome['error']}: {outcome['message']}{fits}")
    got = outcome["result"]
    if not isinstance(got, dict) or any(k not in got for k in PLAN_KEYS):
        raise AssertionError(f"{what} returned {got!r}; expected a dict with keys {', '.join(PLAN_KEYS)}")
    layout = {k: got[k] for k in ("dp", "tp", "pp", "micro")}
    try:
        predicted = predict(model, cluster, **layout)
    except (ValueError, TypeError) as error:
        raise AssertionError(f"{what} returned {layout}, which is no layout of this model on this cluster: "
                             f"{error}") from None
    for key in ("time", "memory"):
        if not isinstance(got[key], (int, float)) or not math.isclose(got[key], predicted[key],
                                                                     rel_tol=SCALAR[1]):
            raise AssertionError(f"{what} returned {key} = {got[key]!r} for {layout}; predict gives "
                                 f"{predicted[key]:.6g}: return the values predict computes")
    if predicted["memory"] > cluster["memory"]:
        raise AssertionError(f"{what} returned {layout}, which needs {predicted['memory'] / 1e9:.2f} GB per "
                             "GPU: "
                             f"more than the {cluster['memory'] / 1e9:g} GB the GPUs have")
    best_time = predict(model, cluster, **best)["time"]
    if predicted["time"] > best_time * (1 + SCALAR[1]):
        raise AssertionError(f"{what} returned {layout}, predicted {predicted['time']:.6g} s per step; "
                             f"{best} "
                             f"fits and takes {best_time:.6g} s: try every dp, tp, pp and micro-batch count")


def smallest_memory(model, cluster):
    """The least memory per GPU any layout of the model needs on the cluster (trying every one)."""
    from dpcourse.topics.hybrid.costs import layouts, predict

    memories = [predict(model, cluster, *layout)["memory"] for layout in layouts(model, cluster)]
    return min(memories, default=None)


def expect_plan_refused(outcome, model, cluster, what):
    """A ValueError whose message names the smallest memory per GPU any layout needs, in GB."""
    import re

    least = smallest_memory(model, cluster)
    if "error" not in outcome:
        why = (f"nothing fits in {cluster['memory'] / 1e9:g} GB per GPU" if least is not None else
               "no layout uses every GPU with whole layers, sequences, heads and features per rank")
        raise AssertionError(f"{what} returned {describe(outcome['result'])}; {why}: it should raise a "
                             f"ValueError")
    if outcome["error"] != "ValueError":
        raise AssertionError(f"{what} raised {outcome['error']}: {outcome['message']}; expected a ValueError")
    if least is None:  # no layout at all splits the model evenly: any ValueError says so
        return
    least /= 1e9
    numbers = [float(x) for x in re.findall(r"\d+(?:\.\d+)?", outcome["message"])]
    if not any(abs(x - least) <= max(0.051, 0.005 * least) for x in numbers):
        raise AssertionError(f"{what} raised ValueError({outcome['message']!r}); the message should name the "
                             f"smallest memory per GPU any layout needs, {least:.1f} GB")
