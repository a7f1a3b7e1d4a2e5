"""Judge notebook 10's ZeRO exercises from the plain results of dpcourse.topics.zero.runs.

    results = launch_run(zero1_run, 3, ShardedOptimizer, "deep_mlp", 0, 3, 4)
    expect_zero1(results, "deep_mlp", 0, steps=3, per_rank=4, what="ShardedOptimizer")

Every yardstick is computed here, in the test cell's process, never next to the learner's
code: one process training on the same global batches in float64
(reference.flat.single_process_run), the shard rule `chunk_bounds(S, N)` (torch.tensor_split's),
the ring byte counts of comm.volume, and the unit log of topics.zero.units. Failures name the
rank, the step and the elements, and recognise the usual mistakes: state kept for every
parameter, shard boundaries off by one, shards not gathered back after the step, gradients
summed instead of averaged, full gradients kept, a unit never freed.
"""

import math

import torch

from dpcourse.checks.core import TOLERANCES, describe, number, ratio_hint
from dpcourse.checks.params import expect_same_state
from dpcourse.checks.tensors import close
from dpcourse.comm.volume import bytes_sent, ring_traffic, volume_by_op
from dpcourse.reference.flat import element_name, flat, single_process_run
from dpcourse.reference.gradients import single_process_gradients
from dpcourse.reference.splits import chunk_bounds
from dpcourse.topics.zero.runs import run_data
from dpcourse.topics.zero.units import most_unsharded
from dpcourse.toys.data import my_share

ATOL = TOLERANCES["float64 absolute"][0]  # a correct run agrees with the reference to ~1e-15


def _equal(a, b):
    """a equals b within the float64 absolute bound of the table (same shape)."""
    return close(a, b, "float64 absolute")


def _span(a, b):
    return f"elements {a}–{b - 1}" if b - a > 1 else (f"element {a}" if b > a else "no elements")


def reference_of(model, seed, steps, per_rank, world_size):
    """The single-process run that N ranks of runs.* must reproduce (see reference.flat)."""
    make, X, Y = run_data(model, seed, steps, per_rank, world_size)
    return single_process_run(make, X, Y, steps, per_rank * world_size)


def _trainable_flat(state, names):
    return flat([state[name] for name, _ in names])


def _which_chunk(values, full, bounds, exclude):
    """The index of the chunk of `full` (by `bounds`) that `values` equals, or None."""
    for j, (a, b) in enumerate(bounds):
        if j != exclude and b - a == values.numel() and _equal(values, full[a:b]):
            return j
    return None


def _shifted(values, full, a):
    """A shift d (|d| <= 2) such that `values` equals full[a+d : a+d+len]: boundaries off by d."""
    for d in (-2, -1, 1, 2):
        lo = a + d
        if 0 <= lo and lo + values.numel() <= full.numel() and _equal(values, full[lo:lo + values.numel()]):
            return d
    return None


def _boundary_message(who, index, n, numel, got, a, b, what, whose="shard"):
    """`who` ("rank 2") holds shard `index` of a vector of `numel` elements over n ranks."""
    return (f"{who}: {what}: its {whose} has {got} elements, expected {b - a}: {_span(a, b)} of the flat "
            f"vector of S = {numel} (chunk_bounds({numel}, {n})[{index}], torch.tensor_split's rule: the "
            f"first S mod N shards get one extra element). Check the shard boundaries")


# --------------------------------------------------------------------------- common: parameters

def expect_trained_parameters(got, ref, start_flat, bounds, rank, what, steps, shards=None):
    """The flat trainable parameters of one rank against the reference, with a diagnosis.

    shards: every rank's own shard after the last step (what its optimizer stepped), when known:
    parameters that are not those shards side by side point at the all-gather, not the training."""
    want, names = ref["params"], ref["names"]
    if _equal(got, want):
        return
    a, b = bounds[rank]
    wrong = ((got - want).abs() > ATOL).nonzero().flatten().tolist()
    outside = [i for i in wrong if not a <= i < b]
    if len(bounds) > 1 and outside and all(abs(got[i] - start_flat[i]) <= ATOL for i in outside):
        raise AssertionError(
            f"rank {rank}: {what}: after {steps} steps, the parameters outside this rank's own shard "
            f"({len(outside)} elements, e.g. {element_name(names, outside[0])}) still hold their initial "
            f"values: after stepping its shard, every rank must all-gather every rank's updated shard and "
            f"copy it into the parameters")
    if shards is not None:
        expect_assembled(got, shards, bounds, f"rank {rank}: {what}: after {steps} steps, the parameters are",
                         lambda i: element_name(names, i))
    first = wrong[0]
    owners = [r for r, (lo, hi) in enumerate(bounds) if lo <= first < hi]
    raise AssertionError(
        f"rank {rank}: {what}: after {steps} AdamW steps, {len(wrong)} of {want.numel()} parameter elements "
        f"differ from one process trained on the same global batches, e.g. {element_name(names, first)} "
        f"(element {first}, in rank {owners[0]}'s shard) is {number(got[first].item())}, expected "
        f"{number(want[first].item())}")


def expect_assembled(got, shards, bounds, where, name_of=str, what="updated shard"):
    """got (a flat vector) must be the shards side by side, shard j at bounds[j]; else say how the
    all-gather placed them (padding left in the middle, pieces at the wrong place)."""
    if len(shards) != len(bounds) or any(s.numel() != b - a
                                         for s, (a, b) in zip(shards, bounds, strict=True)):
        return  # shard sizes are judged elsewhere
    whole = torch.cat([s.reshape(-1) for s in shards])
    if _equal(got, whole):
        return
    chunk = math.ceil(whole.numel() / len(bounds))
    padded_in_place = torch.cat([torch.cat([s.reshape(-1), s.new_zeros(chunk - s.numel())]) for s in shards])
    wrong = ((got.double() - whole.double()).abs() > ATOL).nonzero().flatten().tolist()
    first = wrong[0]
    owner = next(j for j, (a, b) in enumerate(bounds) if a <= first < b)
    if _equal(got, padded_in_place[:got.numel()]):
        hint = (f"the all-gather's pieces were joined with their padding and cut at the end, so from element "
                f"{first} on everything sits one or more places late. Keep the first b_j - a_j elements of "
                f"piece j (its shard's size, chunk_bounds) before joining them")
    else:
        j = next((j for j, s in enumerate(shards) if s.numel() and first < got.numel()
                  and _equal(got[first:first + s.numel()], s.reshape(-1))), None)
        placed = (f"; they hold rank {j}'s shard, which belongs at {_span(*bounds[j])}" if j is not None
                  and j != owner else "")
        hint = (f"piece j of the all-gather belongs at chunk_bounds(S, N)[j] (its first b_j - a_j elements)"
                f"{placed}")
    raise AssertionError(
        f"{where} not every rank's {what} side by side: {len(wrong)} of {got.numel()} elements differ "
        f"from the ranks' shards, from {name_of(first)} (element {first}, rank {owner}'s "
        f"shard, {_span(*bounds[owner])}) on: {hint}")


# --------------------------------------------------------------------------- 1. ShardedOptimizer

def expect_zero1(results, model, seed, steps, per_rank, what="ShardedOptimizer"):
    """Judge runs.zero1_run: optimizer state for this rank's shard only, training equal to one
    process, one all-gather's worth of bytes per step."""
    n = len(results)
    ref = reference_of(model, seed, steps, per_rank, n)
    numel = ref["params"].numel()
    bounds = chunk_bounds(numel, n)
    element = ref["params"].element_size()
    for rank, result in enumerate(results):
        if result.get("step_error"):
            raise AssertionError(
                f"rank {rank}: {what}: step(gradient_shard) raised {result['step_error']} -- here every "
                f"p.grad is None, as after reduce_scatter_gradients (ZeRO-2 frees the full gradients): when "
                f"step() is given gradient_shard, it must step with that argument, not with the .grads")
    for rank, result in enumerate(results):
        a, b = bounds[rank]
        summary = result["optimizer"]
        if n > 1 and summary["numel"] == numel:
            raise AssertionError(
                f"rank {rank}: {what}: the local optimizer steps all {numel} elements of the model (its "
                f"state: {summary['state_bytes']} bytes): ZeRO-1 keeps optimizer state for this rank's "
                f"shard only, {_span(a, b)} of the flat parameter vector (chunk_bounds({numel}, {n})"
                f"[{rank}]): about 1/{n} of it")
        if summary["numel"] != b - a:
            raise AssertionError(_boundary_message(f"rank {rank}", rank, n, numel, summary["numel"], a, b,
                                                   what, "shard (what its optimizer steps)"))
        padded = math.ceil(numel / n) * element  # a shard may live in its padded send buffer
        if summary["storage_bytes"] > padded:
            raise AssertionError(
                f"rank {rank}: {what}: the shard the optimizer steps lives in a storage of "
                f"{summary['storage_bytes']} bytes, but its {b - a} elements need {(b - a) * element}: it is "
                f"a view into a full-size tensor, which stays in memory as long as the shard does. "
                f"Make the shard its own tensor (.clone() the slice)")
    start = ref["start"]
    for rank, result in enumerate(results):
        got = _trainable_flat(result["state"], ref["names"])
        shards = [r["optimizer"].get("values") for r in results]
        try:
            expect_trained_parameters(got, ref, start, bounds, rank, what, steps,
                                      None if any(s is None for s in shards) else shards)
        except AssertionError as error:
            if not result.get("explicit") or "side by side" in str(error):
                raise
            raise AssertionError(f"{error} -- step() was given gradient_shard, this rank's shard of the "
                                 f"averaged gradient, while every p.grad was None: step with that "
                                 f"argument") from None
        expect_same_state(result["state"], ref["state"], f"{what}, after {steps} steps", rank=rank, atol=ATOL)
    for rank, result in enumerate(results):
        a, b = bounds[rank]
        for key, full in ref["optimizer"].items():
            mine = result["optimizer"]["state"].get(key)
            if mine is None:
                raise AssertionError(f"rank {rank}: {what}: the local optimizer has no '{key}' state")
            if not _equal(mine, full[a:b]):
                j = _which_chunk(mine, full, bounds, rank)
                hint = (f" -- it is the state of chunk {j} ({_span(*bounds[j])}): rank r owns chunk r"
                        if j is not None else "")
                raise AssertionError(
                    f"rank {rank}: {what}: the local optimizer's {key} is {describe(mine)}, expected the "
                    f"single-process {key} of {_span(a, b)} {describe(full[a:b])}{hint}")
        per_element = len(ref["optimizer"]) * element
        limit = per_element * (b - a) + 64  # + a few step counters
        if result["optimizer"]["state_bytes"] > limit:
            raise AssertionError(
                f"rank {rank}: {what}: the local optimizer's state holds "
                f"{result['optimizer']['state_bytes']} bytes, expected about {per_element * (b - a)} "
                f"({len(ref['optimizer'])} x {b - a} elements x {element} bytes) for its shard")
    expect_all_gather_traffic(results, numel, element, what, steps)


def _per_step(ops, n, steps):
    sent = bytes_sent(ops, n)
    by_op = ", ".join(f"{op} {v / steps:.0f}" for op, v in volume_by_op(ops, n).items()) or "nothing"
    return sent / steps, by_op


def expect_all_gather_traffic(results, numel, element, what, steps):
    """A step() sends at most one all-gather's worth: (N-1) padded shards of ⌈S/N⌉ elements."""
    n = len(results)
    chunk = math.ceil(numel / n)
    limit = (n - 1) * chunk * element
    for rank, result in enumerate(results):
        sent, by_op = _per_step(result["ops"], n, steps)
        if sent > limit + 0.5:
            raise AssertionError(
                f"rank {rank}: {what}: step() sent {sent:.0f} bytes per step ({by_op}), "
                f"{sent / max(limit, 1):.2f}x an all-gather of the shards: (N-1)/N·S = {n - 1}/{n} x "
                f"{numel * element} bytes (padded: {n - 1} x {chunk} elements x {element} bytes = "
                f"{limit}). An all-reduce would send twice that")


# --------------------------------------------------------------------------- 2. reduce_scatter_gradients

def _local_first_gradient(model, seed, steps, per_rank, rank, n):
    make, X, Y = run_data(model, seed, steps, per_rank, n)
    net = make()
    grads = single_process_gradients(net, *my_share(X, Y, 0, per_rank, rank, n, "cpu"))
    return flat([grads[name] for name, p in net.named_parameters() if p.requires_grad])


def expect_zero2(results, model, seed, steps, per_rank, what="reduce_scatter_gradients"):
    """Judge runs.zero2_run: each step returns this rank's shard of the averaged gradient, keeps
    no full gradient, and sends one reduce-scatter's worth of bytes; training equals one process."""
    n = len(results)
    ref = reference_of(model, seed, steps, per_rank, n)
    numel = ref["params"].numel()
    bounds = chunk_bounds(numel, n)
    element = ref["params"].element_size()
    chunk = math.ceil(numel / n)
    for step in range(steps):
        average = ref["grads"][step]
        for rank, result in enumerate(results):
            a, b = bounds[rank]
            where = f"{what}, step {step}"
            if step >= len(result["shards"]):
                continue  # the run stopped at an earlier step's wrong shard, reported below
            shard = result["shards"][step]
            if not isinstance(shard, torch.Tensor):
                raise AssertionError(f"rank {rank}: {where} returned {describe(shard)[:80]}, expected a "
                                     f"tensor: this rank's shard of the averaged gradient")
            shard = shard.reshape(-1)
            if shard.numel() != b - a:
                raise AssertionError(_boundary_message(f"rank {rank}", rank, n, numel, shard.numel(), a, b,
                                                       where, "gradient shard"))
            if not _equal(shard, average[a:b]):
                raise AssertionError(_gradient_shard_message(shard, average, bounds, rank, n, where, model,
                                                             seed, steps, per_rank, step))
            if result["held"][step]:
                raise AssertionError(
                    f"rank {rank}: after {where}, the parameters still hold full gradients "
                    f"({result['held'][step]} elements in their .grad): ZeRO-2 keeps only this rank's "
                    f"shard ({b - a} elements); set every p.grad to None once it is reduce-scattered")
    limit = (n - 1) * chunk * element
    for rank, result in enumerate(results):
        sent, by_op = _per_step(result["ops"], n, steps)
        if sent > limit + 0.5:
            raise AssertionError(
                f"rank {rank}: {what} sent {sent:.0f} bytes per step ({by_op}), "
                f"{sent / max(limit, 1):.2f}x a reduce-scatter: (N-1)/N·S = {n - 1}/{n} x "
                f"{numel * element} bytes (padded: {limit}). An all-reduce sends 2(N-1)/N·S and gives "
                f"every rank the whole average, which ZeRO-2 would throw away")


def _gradient_shard_message(shard, average, bounds, rank, n, where, model, seed, steps, per_rank, step):
    a, b = bounds[rank]
    hint = ""
    if n > 1 and _equal(shard, n * average[a:b]):
        hint = f" -- {n} times the average: a reduce-scatter sums over ranks; divide by N = {n}"
    elif (j := _which_chunk(shard, average, bounds, rank)) is not None:
        hint = f" -- that is the average of chunk {j} ({_span(*bounds[j])}): rank r keeps chunk r"
    elif (d := _shifted(shard, average, a)) is not None:
        hint = (f" -- that is {_span(a + d, b + d)}: the shard boundaries are off by {d} (rank r's shard is "
                f"chunk_bounds(S, N)[r])")
    elif step == 0:
        local = _local_first_gradient(model, seed, steps, per_rank, rank, n)
        if _equal(shard, local[a:b]):
            hint = " -- that is this rank's own gradient: it was never reduced over ranks"
        elif n > 1 and _equal(shard, local[a:b] / n):
            hint = " -- that is this rank's own gradient divided by N: the reduction did not happen"
    if not hint:
        hint = ratio_hint(shard, average[a:b])
    return (f"rank {rank}: {where} returned {describe(shard)}, expected its shard of the gradient "
            f"averaged over ranks, {_span(a, b)}: {describe(average[a:b])}{hint}")


# --------------------------------------------------------------------------- 3. MiniFSDP

def unit_layout(model, seed):
    """[(unit name, [(parameter name, numel)])]: the children with trainable parameters, in order."""
    make, _, _ = run_data(model, seed, 1, 1, 1)
    net = make()
    units = []
    for name, child in net.named_children():
        params = [(f"{name}.{p_name}", p.numel())
                  for p_name, p in child.named_parameters() if p.requires_grad]
        if params:
            units.append((name, params))
    return units


def expect_fsdp(results, model, seed, steps, per_rank, what="MiniFSDP", max_unsharded=2):
    """Judge runs.fsdp_run: flat shards by chunk_bounds per unit, equal training, averaged gradient
    shards, at most `max_unsharded` units unsharded at once, 1/N of the memory between steps, and
    3(N-1)/N·S bytes per step (all-gather in forward, all-gather in backward, reduce-scatter)."""
    layout = unit_layout(model, seed)
    groups = {}
    for world_rank in range(len(results)):
        groups.setdefault(id_of_group(results, world_rank), []).append(world_rank)
    for members in groups.values():
        grouped = f" (the group of world ranks {members})" if len(groups) > 1 else ""
        _expect_fsdp_group([results[r] for r in members], members, layout, model, seed, steps, per_rank,
                           what + grouped, max_unsharded)


def id_of_group(results, world_rank):
    """Ranks whose runs share a group: consecutive world ranks with group ranks 0..size-1."""
    return world_rank - results[world_rank]["group_rank"]


def _expect_fsdp_group(results, members, layout, model, seed, steps, per_rank, what, max_unsharded):
    n = len(results)
    ref = reference_of(model, seed, steps, per_rank, n)
    element = ref["params"].element_size()
    names = [name for name, _ in layout]
    offsets, offset = {}, 0
    for name, params in layout:
        size = sum(k for _, k in params)
        offsets[name] = (offset, offset + size)
        offset += size
    for result, rank in zip(results, members, strict=True):
        if result["units"] != names:
            raise AssertionError(f"rank {rank}: {what}'s units are {result['units']}, expected {names}: one "
                                 f"unit per child module with trainable parameters, in order")
        if len(result["shards"]) != len(names):
            raise AssertionError(f"rank {rank}: {what} has {len(result['shards'])} shards, expected one per "
                                 f"unit ({len(names)})")
    for u, name in enumerate(names):
        lo, hi = offsets[name]
        bounds = chunk_bounds(hi - lo, n)
        for result, rank in zip(results, members, strict=True):
            g = result["group_rank"]
            got = result["shards"][u].reshape(-1).numel()
            if got != bounds[g][1] - bounds[g][0]:
                raise AssertionError(_boundary_message(f"rank {rank}", g, n, hi - lo, got, *bounds[g],
                                                       f"{what}, unit {name}"))
    for u, name in enumerate(names):  # what each unit's first forward ran on: the gather, before its use
        lo, hi = offsets[name]
        bounds = chunk_bounds(hi - lo, n)
        initial = ref["start"][lo:hi]
        for result, rank in zip(results, members, strict=True):
            seen = (result.get("gathered") or [None] * len(names))[u]
            if seen is None or _equal(seen.reshape(-1), initial):
                continue
            expect_assembled(seen.reshape(-1), [initial[a:b] for a, b in bounds], bounds,
                             f"rank {rank}: {what}: unit {name}, as gathered for its first forward, is",
                             lambda i, lo=lo: element_name(ref["names"], lo + i), what="shard")
    for u, name in enumerate(names):
        lo, hi = offsets[name]
        bounds = chunk_bounds(hi - lo, n)
        for result, rank in zip(results, members, strict=True):
            g = result["group_rank"]
            a, b = bounds[g]
            first = ref["grads"][0][lo:hi]
            grad = None if result["grads"] is None else result["grads"][u]
            passes = result.get("accumulate", 1)
            after = "the first backward" if passes == 1 else f"the {passes} backward passes of the first step"
            where = f"{what}, unit {name}, after {after}"
            if grad is None:
                raise AssertionError(f"rank {rank}: {where}: its shard has no gradient (.grad is None): "
                                     f"reduce-scatter the unit's gradient into shard.grad")
            grad = grad.reshape(-1)
            if not _equal(grad, first[a:b]):
                hint = ""
                k = passes
                if n > 1 and _equal(grad, n * first[a:b]):
                    hint = f" -- {n} times the average: a reduce-scatter sums over ranks; divide by N = {n}"
                elif (j := _which_chunk(grad, first, bounds, g)) is not None:
                    hint = f" -- that is the average of chunk {j}: rank r keeps chunk r"
                elif k > 1 and _equal(grad, _last_part(model, seed, steps, per_rank, n, k)[lo + a:lo + b]):
                    hint = (f" -- that is the last backward's gradient alone: here each step runs {k} "
                            f"backward passes (gradient accumulation), so add the reduce-scattered part to "
                            f"an existing shard.grad instead of replacing it")
                raise AssertionError(
                    f"rank {rank}: {where}: its shard's gradient is {describe(grad)}, expected the "
                    f"average over ranks of {_span(lo + a, lo + b)} of the flat gradient: "
                    f"{describe(first[a:b])}{hint}")
    for result, rank in zip(results, members, strict=True):
        _expect_units_freed(result, rank, what, max_unsharded)
    for u, name in enumerate(names):
        lo, hi = offsets[name]
        assembled = torch.cat([r["shards"][u].reshape(-1) for r in results])
        want = ref["params"][lo:hi]
        if not _equal(assembled, want):
            wrong = ((assembled - want).abs() > ATOL).nonzero().flatten().tolist()
            index = lo + wrong[0]
            raise AssertionError(
                f"{what}: after {steps} AdamW steps, unit {name}'s shards differ from one process "
                f"trained on the same global batches in {len(wrong)} of {hi - lo} elements, e.g. "
                f"{element_name(ref['names'], index)} is {number(assembled[wrong[0]].item())}, expected "
                f"{number(want[wrong[0]].item())}")
    for result, rank in zip(results, members, strict=True):
        for name, value in result["frozen"].items():
            if not torch.equal(value.cpu(), ref["state"][name].cpu()):
                raise AssertionError(f"rank {rank}: {what}: the frozen parameter {name} changed")
        _expect_memory(result, rank, n, layout, element, what)
        passes = result.get("accumulate", 1)
        _expect_fsdp_traffic(result, rank, n, layout, element, what, steps * passes,
                             "step" if passes == 1 else "forward and backward")


def _last_part(model, seed, steps, per_rank, n, parts):
    """The flat gradient the last of `parts` backward passes of step 0 adds (runs.fsdp_run): the mean
    loss over every rank's last part of its share, divided by `parts`."""
    make, X, Y = run_data(model, seed, steps, per_rank, n)
    net = make()
    rows = [my_share(X, Y, 0, per_rank, rank, n, "cpu") for rank in range(n)]
    x = torch.cat([xb.chunk(parts)[-1] for xb, _ in rows])
    y = torch.cat([yb.chunk(parts)[-1] for _, yb in rows])
    grads = single_process_gradients(net, x, y)
    return flat([grads[name] / parts for name, p in net.named_parameters() if p.requires_grad])


def _expect_units_freed(result, rank, what, max_unsharded):
    events = result["events"]
    if not any(e[0] == "alloc" for e in events):
        raise AssertionError(f"rank {rank}: {what} never gathered a unit with FlatUnit.alloc(): allocate a "
                             f"unit's memory with unit.alloc() and all-gather the shards into unit.buffer "
                             f"before each unit's forward and backward")
    count, units, event = most_unsharded(events)
    if count > max_unsharded:
        kind, name, in_backward = event
        phase = "backward" if in_backward else ("the step" if kind == "mark" else "forward")
        verb = "gathered" if kind == "alloc" else "freed"
        at = f"at {name}" if kind == "mark" else f"when {name} was {verb}"
        hint = ("free each unit after its backward (once its gradient is reduce-scattered)" if in_backward
                or kind == "mark" else "free each unit after its forward (a forward hook), and gather it "
                "again for its backward")
        if kind == "mark" and name == "built":
            hint = "free each unit once its shard is taken, in the constructor"
        raise AssertionError(f"rank {rank}: {what}: {count} units were unsharded at once "
                             f"({', '.join(units)}) {at}, in {phase}: ZeRO-3 keeps at most {max_unsharded} "
                             f"-- {hint}")
    last = {}
    for kind, name, _, _ in events:
        if kind in ("create", "alloc", "free"):
            last[name] = kind
    still = sorted(name for name, kind in last.items() if kind != "free")
    if still:
        raise AssertionError(f"rank {rank}: {what}: units {still} were still unsharded after the last step: "
                             f"free each unit after its backward, once its gradient is reduce-scattered")


def _expect_memory(result, rank, n, layout, element, what):
    # its shards, each allowed its padding to ⌈numel/N⌉ (a shard may live in its send buffer)
    shard_bytes = sum(math.ceil(sum(k for _, k in params) / n) * element for _, params in layout)
    frozen = sum(t.numel() * t.element_size() for t in result["frozen"].values())
    held = result["held"]
    if held["weights"] > shard_bytes + frozen:
        raise AssertionError(f"rank {rank}: {what} holds {held['weights']} bytes of weights between steps, "
                             f"expected its shards: {shard_bytes} bytes (+ {frozen} of frozen parameters). "
                             f"Free every unit after use")
    if held["gradients"] > shard_bytes:
        raise AssertionError(f"rank {rank}: {what} holds {held['gradients']} bytes of gradients after the "
                             f"step, expected only its shards' gradients ({shard_bytes} bytes): drop the "
                             f"unit's full gradient (unit.full.grad = None) once it is reduce-scattered")


def _expect_fsdp_traffic(result, rank, n, layout, element, what, steps, per="step"):
    if n == 1:
        return
    per_unit = [math.ceil(sum(k for _, k in params) / n) for _, params in layout]
    limit = 3 * (n - 1) * sum(per_unit) * element
    total = sum(sum(k for _, k in params) for _, params in layout) * element
    sent, by_op = _per_step(result["ops"], n, steps)
    if sent > limit + 0.5:
        ideal = ring_traffic(total, n, phases=1)[1]
        raise AssertionError(
            f"rank {rank}: {what} sent {sent:.0f} bytes per {per} ({by_op}) = {sent / ideal:.2f}(N-1)/N·S, "
            f"expected 3(N-1)/N·S = {3 * ideal:.0f} (padded: {limit}): one all-gather per unit in "
            f"forward, one in backward, one reduce-scatter")
