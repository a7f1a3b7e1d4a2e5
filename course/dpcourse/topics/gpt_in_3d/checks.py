"""Verdicts for notebook 13's test cells: what the ranks reported (runs.py) against one process, in float64.

Used by notebook 13's visible tests and by its hidden checks (autograder/dpgrader/gpt_in_3d/checks.py).

Every expected value is computed here, in the test cell's process, never in a rank: the mesh from
init_device_mesh's layout (torch.arange(world).view(dp, pp, tp), the last dim varying fastest); one block,
one pipeline stage or one sharded model from the unsharded float64 model on the same rows; the 3-D steps and
the resumed run from reference.lm.single_process_lm. Each message names the rank, its coordinates in the
mesh, the parameter or the step, and the likely mistake when the numbers have a known signature.
"""

import itertools

import torch

from dpcourse.checks.core import describe, expect_close, is_close, ratio_hint
from dpcourse.comm.volume import ring_bytes
from dpcourse.reference.lm import Recipe, global_batch, single_process_lm
from dpcourse.topics.gpt_in_3d.runs import AXES, block_of, coordinates, phase_ops, rows_of
from dpcourse.toys.gpt import GPTConfig, gpt, lm_loss

LOSS_TOLERANCE = {torch.float64: (1e-9, 1e-9), torch.float32: (2e-5, 2e-5)}  # per step, atol and rtol


# --------------------------------------------------------------------------- 1. the mesh

def expected_mesh(layout):
    """Per world rank: its coordinates and, per axis, the world ranks of its group, as init_device_mesh lays
    out a (dp, pp, tp) mesh."""
    dp, pp, tp = layout
    grid = torch.arange(dp * pp * tp).view(dp, pp, tp)
    out = []
    for rank in range(dp * pp * tp):
        c = coordinates(layout, rank)
        members = {"dp": grid[:, c["pp"], c["tp"]].tolist(), "pp": grid[c["dp"], :, c["tp"]].tolist(),
                   "tp": grid[c["dp"], c["pp"], :].tolist()}
        out.append({"coords": [c[a] for a in AXES], "members": members})
    return out


def expect_mesh(reports, layout, what):
    """Every rank's mesh: names ("dp", "pp", "tp"), shape, its coordinate and its group along each dim."""
    want = expected_mesh(layout)
    for rank, (got, expected) in enumerate(zip(reports, want, strict=True)):
        if "raised" in got:
            kind, message = got["raised"]
            raise AssertionError(f"{what}: rank {rank} raised {kind}: {message}")
        if got.get("outside"):
            raise AssertionError(f"{what}: rank {rank} is not in its own mesh of shape {got['shape']}")
        for axis in AXES:  # the groups first: a swapped order shows as groups of the wrong ranks
            if axis in got["members"] and list(got["members"][axis]) != expected["members"][axis]:
                members = list(got["members"][axis])
                raise AssertionError(f"{what}: rank {rank}'s {axis} group is {members}, expected "
                                     f"{expected['members'][axis]}{_swap_hint(axis, members, layout)}")
        if got["names"] != list(AXES):
            raise AssertionError(f"{what}: rank {rank}'s mesh has dims named {got['names']}, expected "
                                 f"{list(AXES)} (mesh_dim_names, in the order of the shape)")
        if got["shape"] != list(layout):
            raise AssertionError(f"{what}: rank {rank}'s mesh has shape {got['shape']}, expected "
                                 f"{list(layout)} "
                                 f"(dp, pp, tp)")
        for axis in AXES:
            members = list(got["members"][axis])
            if members != expected["members"][axis]:
                raise AssertionError(f"{what}: rank {rank}'s {axis} group is {members}, expected "
                                     f"{expected['members'][axis]}{_swap_hint(axis, members, layout)}")
        if got["coords"] != expected["coords"]:
            raise AssertionError(f"{what}: rank {rank}'s coordinate is {got['coords']}, expected "
                                 f"{expected['coords']} (dp, pp, tp)")


def _swap_hint(axis, members, layout):
    """Why a group is wrong, when it has a known signature: a tp group that is not neighbouring ranks."""
    if axis == "tp" and len(members) > 1 and abs(members[1] - members[0]) != 1:
        return (f" -- a tensor-parallel group must be neighbouring ranks (ranks r, r + 1, ...: the same "
                f"node, "
                f"the fastest links), so tp is the last dim of the shape, the one that varies fastest; "
                f"this group's ranks are {abs(members[1] - members[0])} apart")
    if axis == "dp" and layout[1] * layout[2] > 1 and len(members) > 1 and members[1] - members[0] == 1:
        return " -- dp and tp are swapped: dp is the first dim of the shape (it varies slowest)"
    if axis == "pp" and layout[2] > 1 and len(members) > 1 and members[1] - members[0] == 1:
        return (" -- pp and tp are swapped: tp is the last dim of the shape, the one that varies fastest "
                "(neighbouring ranks), pp the one before it")
    return ""


def expect_sizes_refused(reports, layout, what):
    """make_mesh with dp x pp x tp != the world size: every rank raises a ValueError naming the sizes."""
    world = len(reports)
    for rank, got in enumerate(reports):
        if "raised" not in got:
            raise AssertionError(f"{what}: rank {rank} returned a mesh for {layout} on {world} ranks: raise "
                                 f"a "
                                 f"ValueError when dp x pp x tp = {layout[0] * layout[1] * layout[2]} is not "
                                 f"the "
                                 f"world size {world}")
        kind, message = got["raised"]
        if kind != "ValueError":
            raise AssertionError(f"{what}: rank {rank} raised {kind} ({message[:200]}), expected a "
                                 f"ValueError")
        missing = [str(n) for n in (layout[0] * layout[1] * layout[2], world) if str(n) not in message]
        if missing:
            raise AssertionError(f"{what}: rank {rank}'s ValueError says {message[:200]!r}: say which sizes "
                                 f"do "
                                 f"not match (it lacks {', '.join(missing)})")


# --------------------------------------------------------------------------- 2. one block, tp + sp

COLUMN = ("attn.q.weight", "attn.q.bias", "attn.k.weight", "attn.k.bias", "attn.v.weight", "attn.v.bias",
          "mlp.fc1.weight", "mlp.fc1.bias")
ROW = ("attn.proj.weight", "mlp.fc2.weight")


def block_reference(case):
    """Per replica: the unsharded float64 block's (output, input gradient, parameter gradients) on its x and
    dy, with the generator seeded as the ranks seed it (dropout draws the same masks)."""
    config, out = GPTConfig(**case["config"]), []
    for x, dy in case["replicas"]:
        block = block_of(config, case["seed"])
        x = x.clone().requires_grad_()
        torch.manual_seed(case.get("rng_seed", 0))
        y = block(x)
        y.backward(dy)
        out.append((y.detach(), x.grad, {n: p.grad for n, p in block.named_parameters()}))
    return out


def expect_block(reports, case, what):
    """Every rank of the block case: its piece of the output and of the input gradient, each parameter's
    placement (column-parallel Linears Shard(0), row-parallel Shard(1), LayerNorms replicated) and whole
    gradient, and the forward's communication: an all-gather before attention and the MLP, a reduce-scatter
    after each (no all-reduce: the output stays split along the sequence)."""
    tp, reference = case["tp"], block_reference(case)
    for rank, got in enumerate(reports):
        replica, t = divmod(rank, tp)
        y, x_grad, grads = reference[replica]
        where = f"{what}: rank {rank} (tp rank {t} of {tp})"
        piece = y.tensor_split(tp, dim=1)[t]
        if got["output"].shape != piece.shape:
            raise AssertionError(f"{where}: the block returned shape {tuple(got['output'].shape)}, expected "
                                 f"{tuple(piece.shape)}, this rank's piece of the sequence (dim 1): the "
                                 f"block's "
                                 f"output must stay sequence-parallel "
                                 f"(RowwiseParallel(output_layouts=Shard(1)))")
        positions = _positions(y, tp, t)
        _expect_values(got["output"], piece, f"{where}: the block's output (positions {positions})",
                       dropout=case["config"].get("dropout", 0.0))
        for name, style in [(n, "column") for n in COLUMN] + [(n, "row") for n in ROW]:
            placements = got["params"][name]["placements"]
            if style == "column":
                want, splits, api = ["S(0)"], "output features (the rows of its weight)", "ColwiseParallel"
            else:
                want, splits, api = ["S(1)"], "input features (the columns of its weight)", "RowwiseParallel"
            if placements != want:
                raise AssertionError(f"{where}: {name} is {_placement(placements)}, expected {want[0]}: a "
                                     f"{style}-parallel Linear splits its {splits} over tp ({api})")
        expect_close(got["input_grad"], x_grad.tensor_split(tp, dim=1)[t], f"{where}: the gradient of its "
                     f"piece "
                     f"of the block's input")
        for name, want in grads.items():
            hint = ""
            if name.startswith("norm") and not got["params"][name]["placements"]:
                hint = (" -- this LayerNorm is a plain module: each rank computed it on its own tokens only, "
                        "so "
                        "its gradient is this rank's share, never summed over the tp group; SequenceParallel "
                        "makes it a replicated DTensor whose gradients torch sums over tp")
            expect_close(got["grads"][name], want, f"{where}: the gradient of {name}", hint=hint)
        forward = [o for o in phase_ops(got, "forward")]
        gathers = [o for o in forward if o.op == "all_gather_into_tensor"]
        scatters = [o for o in forward if o.op == "reduce_scatter_tensor"]
        reduces = [o for o in forward if o.op == "all_reduce"]
        if tp > 1 and (len(gathers) != 2 or len(scatters) != 2 or reduces):
            raise AssertionError(f"{where}: the forward made {_calls(forward)}, expected 2 all-gathers (the "
                                 f"sequence gathered before attention and before the MLP) and 2 "
                                 f"reduce-scatters "
                                 f"(after proj and fc2), no all-reduce: Megatron's sequence parallelism")


def _positions(y, tp, t):
    s = y.shape[1]
    bounds = [len(p) for p in torch.arange(s).tensor_split(tp)]
    start = sum(bounds[:t])
    return f"{start}..{start + bounds[t] - 1}"


def _placement(placements):
    return "a plain tensor (not parallelized)" if not placements else ", ".join(placements)


def _expect_values(got, want, what, dropout=0.0):
    hint = ""
    if dropout and not is_close(got, want):
        hint = ("with dropout on, a rank's mask must be its piece of the mask of the whole tensor: the "
                "dropout "
                "has to run in the sequence-parallel region (SequenceParallel on it), where it sees a "
                "DTensor of "
                "the whole sequence; given a plain tensor, each rank draws a mask for its own piece as if it "
                "were all of it, and the tp ranks' masks are no longer pieces of one")
    expect_close(got, want, what, hint=hint)


def _calls(ops):
    counts = {}
    for o in ops:
        counts[o.op] = counts.get(o.op, 0) + 1
    return ", ".join(f"{n} {op}" for op, n in counts.items()) or "no collective"


# --------------------------------------------------------------------------- 3. pipeline stages

def best_cuts(costs, n_stages):
    """The smallest possible slowest stage over every way of cutting `costs` into n contiguous stages."""
    n, best = len(costs), None
    for inner in itertools.combinations(range(1, n), n_stages - 1):
        cuts = [0, *inner, n]
        slowest = max(sum(costs[a:b]) for a, b in itertools.pairwise(cuts))
        best = slowest if best is None else min(best, slowest)
    return best


def pipeline_reference(case):
    """Per dp rank: (the micro-batches' losses, {name: gradient}) of the whole float64 model on its rows."""
    config, dp = GPTConfig(**case["config"]), case["layout"][0]
    out = []
    for d in range(dp):
        rows = rows_of(case["rows"], dp, d)
        model = gpt(config, seed=case["seed"], dtype=torch.float64)
        losses = []
        total = 0
        for micro in rows.tensor_split(case["n_micro"]):
            loss = lm_loss(model(micro[:, :-1]), micro[:, 1:])
            losses.append(loss.item())
            total = total + loss / case["n_micro"]
        total.backward()
        out.append((losses, {n: p.grad for n, p in model.named_parameters()}))
    return out


def expect_pipeline(reports, case, what):
    """Every rank's stage: the blocks of its balanced cut (no cut makes the slowest stage cheaper), the
    embeddings on the first stage only and the head on the last, a Schedule1F1B of the case's micro-batches
    on the pp group, and after one step the last stage's losses and every stage's gradients equal the whole
    model's on the rank's rows."""
    (dp, pp), costs = case["layout"], list(case["costs"])
    reference, layout = pipeline_reference(case), (dp, pp, 1)
    held = {}
    for rank, got in enumerate(reports):
        c = coordinates(layout, rank)
        where = f"{what}: rank {rank} (stage {c['pp']} of {pp}, dp rank {c['dp']})"
        if got["schedule"] != "Schedule1F1B":
            raise AssertionError(f"{where}: the schedule is {got['schedule']}, expected Schedule1F1B")
        if got["n_micro"] != case["n_micro"]:
            raise AssertionError(f"{where}: the schedule runs {got['n_micro']} micro-batches, expected "
                                 f"{case['n_micro']}")
        if got.get("stage_index") != c["pp"] or got.get("n_stages") != pp:
            raise AssertionError(f"{where}: its PipelineStage is stage {got.get('stage_index')} of "
                                 f"{got.get('n_stages')}, expected stage {c['pp']} of {pp}: the index is the "
                                 f"rank's coordinate along pp (pp_mesh.get_local_rank()), not its world rank")
        group = expected_mesh(layout)[rank]["members"]["pp"]
        if got.get("group") != group:
            raise AssertionError(f"{where}: its PipelineStage talks on the group {got.get('group')}, "
                                 f"expected its "
                                 f"pp group {group} (group=pp_mesh.get_group())")
        held.setdefault(c["pp"], got["blocks"])
    blocks = [held[s] for s in range(pp)]
    flat = [b for stage in blocks for b in stage]
    if flat != [str(i) for i in range(len(costs))] or any(not stage for stage in blocks):
        raise AssertionError(f"{what}: the stages hold blocks {blocks}: expected every block once, in order, "
                             f"at "
                             f"least one per stage")
    for rank, got in enumerate(reports):
        c = coordinates(layout, rank)
        if got["has_embeddings"] != (c["pp"] == 0) or got["has_head"] != (c["pp"] == pp - 1):
            raise AssertionError(f"{what}: rank {rank} (stage {c['pp']} of {pp}) holds the embeddings: "
                                 f"{got['has_embeddings']}, the head: {got['has_head']}; only the first "
                                 f"stage "
                                 f"embeds, only the last has the head")
    slowest = max(sum(costs[int(b)] for b in stage) for stage in blocks)
    best = best_cuts(costs, pp)
    if slowest > best + 1e-12:
        raise AssertionError(f"{what}: the stages hold blocks {blocks} of costs {costs}: the slowest stage "
                             f"costs "
                             f"{slowest:g}, a better cut's slowest costs {best:g} (partition_layers of "
                             f"notebook 07)")
    for rank, got in enumerate(reports):
        c = coordinates(layout, rank)
        losses, grads = reference[c["dp"]]
        where = f"{what}: rank {rank} (stage {c['pp']} of {pp}, dp rank {c['dp']})"
        if c["pp"] == pp - 1:
            expect_close(torch.tensor(got["losses"], dtype=torch.float64), torch.tensor(losses),
                         f"{where}: the micro-batches' losses")
        for name, grad in got["grads"].items():
            expect_close(grad, grads[name], f"{where}: the gradient of {name} after the step")


# --------------------------------------------------------------------------- 4. fully_shard and the data

def expect_sharded(reports, case, what):
    """Every parameter a DTensor sharded on dim 0 over the dp mesh (each block its own FSDP group: one
    all-gather per block and one for the root in forward, as many reduce-scatters in backward), and every
    rank's gradient, gathered, the whole global batch's (FSDP averages over dp)."""
    config, dp = GPTConfig(**case["config"]), case["dp"]
    model = gpt(config, seed=case["seed"], dtype=torch.float64)
    rows = case["rows"]
    loss = lm_loss(model(rows[:, :-1]), rows[:, 1:])
    loss.backward()
    groups = config.n_layers + 1
    for rank, got in enumerate(reports):
        where = f"{what}: rank {rank} (dp rank {rank} of {dp})"
        for name, facts in got["params"].items():
            if facts["placements"] != ["S(0)"] or facts["mesh"] != list(range(dp)):
                raise AssertionError(f"{where}: {name} is {_placement(facts['placements'])} on ranks "
                                     f"{facts['mesh']}, expected Shard(0) over the dp mesh "
                                     f"{list(range(dp))}: "
                                     f"fully_shard every block, then the root (which shards the rest)")
        forward, backward = phase_ops(got, "forward"), phase_ops(got, "backward")
        gathers = [o for o in forward if o.op == "all_gather_into_tensor"]
        scatters = [o for o in backward if o.op == "reduce_scatter_tensor"]
        if dp > 1 and len(gathers) != groups:
            raise AssertionError(f"{where}: the forward made {len(gathers)} all-gather(s) of parameters, "
                                 f"expected "
                                 f"{groups}: one per block and one for the root (each fully_shard call is "
                                 f"one "
                                 f"group, gathered just before it runs and freed after)")
        regathered = [o for o in backward if o.op == "all_gather_into_tensor"]
        if dp > 1 and len(regathered) != config.n_layers:
            raise AssertionError(f"{where}: the backward made {len(regathered)} all-gather(s) of parameters, "
                                 f"expected {config.n_layers}, one per block: each block is freed after its "
                                 f"forward (reshard_after_forward, True for every group but the root) and "
                                 f"gathered "
                                 f"again for its backward -- a block kept whole holds all of its parameters "
                                 f"on every "
                                 f"rank between forward and backward")
        if dp > 1 and len(scatters) != groups:
            raise AssertionError(f"{where}: the backward made {len(scatters)} reduce-scatter(s), expected "
                                 f"{groups}, one per FSDP group")
        for name, p in model.named_parameters():
            expect_close(got["grads"][name], p.grad, f"{where}: the gradient of {name}, gathered",
                         hint="FSDP averages the gradients over the dp mesh: each rank must see its own rows")


def expect_memory_sharded(reports, case, what, model_bytes):
    """Measured from outside the rank (the grader's zygote): building the full model costs about its size,
    sharding it leaves about 1/dp of it, and after the forward the blocks are freed again."""
    dp = case["dp"]
    for rank, got in enumerate(reports):
        measured = got.get("memory")
        if measured is None:
            return  # not graded: nothing measured from outside
        # held: anonymous memory plus shared mappings and the rank's own tmpfs (a copy hidden there counts)
        marks = {label: held for label, held, *_ in measured["marks"]}
        start = marks["start"]
        sharded, after = marks["sharded"] - start, marks["after forward"] - start
        allowance = model_bytes / dp + 0.35 * model_bytes / dp + (1 << 20)
        if sharded > allowance:
            raise AssertionError(f"{what}: rank {rank} holds {sharded / 2**20:.1f} MiB after apply_fsdp, "
                                 f"expected "
                                 f"about {model_bytes / dp / 2**20:.1f} MiB (1/{dp} of the model's "
                                 f"{model_bytes / 2**20:.1f} MiB): a full copy of the parameters is still "
                                 f"alive")
        if after > allowance + 0.5 * model_bytes:
            raise AssertionError(f"{what}: rank {rank} holds {after / 2**20:.1f} MiB after the forward, more "
                                 f"than "
                                 f"half the model beyond its shard: the blocks stayed gathered (one FSDP "
                                 f"group for "
                                 f"the whole model, or reshard_after_forward=False)")


def expect_samples(got_by_rank, n_samples, batch, step, seed, what):
    """dp ranks' samples of one step: batch / dp each, no sample on two ranks, together the step's global
    batch (an epoch is a permutation: reference.lm.global_batch)."""
    dp = len(got_by_rank)
    want = set(global_batch(n_samples, batch, step, seed).tolist())
    seen = {}
    for d, got in enumerate(got_by_rank):
        got = [int(i) for i in (got.tolist() if isinstance(got, torch.Tensor) else got)]
        if len(got) != batch // dp:
            raise AssertionError(f"{what}: dp rank {d} of {dp} takes {len(got)} samples at step {step}, "
                                 f"expected "
                                 f"{batch // dp} (the global batch of {batch} over {dp} ranks)")
        for i in got:
            if i in seen:
                raise AssertionError(f"{what}: sample {i} is on dp ranks {seen[i]} and {d} at step {step}: "
                                     f"no two dp "
                                     f"ranks may see the same sample (each takes its own share: "
                                     f"rank=dp_rank, "
                                     f"num_replicas=dp_size)")
            seen[i] = d
    if set(seen) != want:
        epoch = step // (n_samples // batch)
        raise AssertionError(f"{what}: at step {step} (epoch {epoch}) the dp ranks take samples "
                             f"{sorted(seen)[:8]}..., expected the step's global batch "
                             f"{sorted(want)[:8]}...: the "
                             f"epoch's permutation (DistributedSampler(shuffle=True, seed=seed), "
                             f"set_epoch(epoch)), "
                             f"cut into consecutive steps")


# --------------------------------------------------------------------------- 5. the 3-D steps

def train_reference(case):
    """One process on the case's global batches in float64: each step's loss, norm and lr; the parameters."""
    recipe = case["recipe"] if isinstance(case["recipe"], Recipe) else Recipe(**case["recipe"])
    return single_process_lm(GPTConfig(**case["config"]), case["seed"], case["steps"], recipe)


def expect_steps(got_steps, reference, first, where, dtype=torch.float64):
    """A rank's per-step (loss, norm, lr) against the reference's steps first, first + 1, ..."""
    atol, rtol = LOSS_TOLERANCE[dtype]
    for k, got in enumerate(got_steps):
        step = first + k
        for key, name, hint in (("loss", "loss", _LOSS_HINT), ("norm", "gradient norm (before clipping)",
                                _NORM_HINT), ("lr", "learning rate", _LR_HINT)):
            want = reference[{"loss": "losses", "norm": "norms", "lr": "lrs"}[key]][step]
            if abs(got[key] - want) > atol + rtol * abs(want):
                ratio = f" ({got[key] / want:.3g}x)" if want else ""
                raise AssertionError(f"{where}: step {step}'s {name} is {got[key]:.10g}, expected "
                                     f"{want:.10g}{ratio}"
                                     f"{hint(got, want, step, k)}")


# Each hint is chosen by what was right before it: steps are checked in order, and within a step its loss
# before its gradient norm. A first step's wrong loss is the loss itself; a later step's wrong loss, after a
# right loss and norm, is the update between them; a wrong norm after a right loss of the same step is that
# step's gradient.

def _LOSS_HINT(got, want, step, k):
    if k:
        return (f" -- step {step - 1}'s loss and gradient norm were right, so its update was not: clip the "
                f"gradients with that norm before optimizer.step() (clip_grads_with_norm_), then step the "
                f"optimizer and the schedule once each")
    return (" -- the loss of the step is the mean over the global batch: the last stage's mean of its "
            "micro-batches, sent to every stage (over pp), averaged over dp (not over the whole world)")


def _NORM_HINT(got, want, step, k):
    if k:
        return (f" -- this step's loss is right, its gradient is not: are step {step - 1}'s gradients still "
                f"in .grad (optimizer.zero_grad() once per step, before the backward)?")
    return (" -- clip by the norm of the whole model's gradient: every rank's pieces over tp and dp (a "
            "DTensor "
            "norm's full_tensor()) and every stage's (summed squares over pp), the same number on every rank")


def _LR_HINT(got, want, step, k):
    return " -- step the learning-rate schedule once per step, after the optimizer"


def expect_training(reports, case, what):
    """Every rank of every layout: each step's loss, gradient norm and learning rate equal one process's, and
    after the last step its stage's parameters (gathered) the single-process model's."""
    dtype = getattr(torch, case.get("dtype", "float64"))
    reference = train_reference(case)
    for rank, got in enumerate(reports):
        for layout_report in got["layouts"]:
            layout = tuple(layout_report["layout"])
            c = coordinates(layout, rank)
            where = (f"{what}, layout {layout} (dp, pp, tp): rank {rank} (dp {c['dp']}, pp {c['pp']}, "
                     f"tp {c['tp']})")
            expect_steps(layout_report["steps"], reference, 0, where, dtype)
            expect_parameters(layout_report["params"], reference["params"], where, dtype)


def expect_parameters(got, want, where, dtype=torch.float64):
    """A rank's pieces of its stage's parameters ({name: [offset, values]}) against the same pieces of one
    process's parameters."""
    atol, rtol = LOSS_TOLERANCE[dtype]
    for name, (offset, value) in got.items():
        piece = want[name][tuple(slice(o, o + n) for o, n in zip(offset, value.shape, strict=True))]
        where_in = f" (its piece at {offset})" if any(offset) else ""
        expect_close(value, piece, f"{where}: {name}{where_in} after the steps", atol=atol, rtol=rtol)


# --------------------------------------------------------------------------- 6. checkpoints

def expect_resumed(reports, case, what):
    """The steps before the checkpoint in the first layout, and after loading it in the second, equal one
    uninterrupted process; so do the parameters at the end."""
    dtype = getattr(torch, case.get("dtype", "float64"))
    reference = train_reference(case)
    first, second = (tuple(layout) for layout in case["layouts"])
    split = case["split"]
    for rank, got in enumerate(reports):
        c1, c2 = coordinates(first, rank), coordinates(second, rank)
        expect_steps(got["before"], reference, 0, f"{what}: rank {rank}, layout {first} before the "
                     f"checkpoint "
                     f"(dp {c1['dp']}, pp {c1['pp']}, tp {c1['tp']})", dtype)
        where = (f"{what}: rank {rank}, layout {second} after loading the checkpoint of {first} "
                 f"(dp {c2['dp']}, pp {c2['pp']}, tp {c2['tp']})")
        try:
            expect_steps(got["after"], reference, split, where, dtype)
            expect_parameters(got["params"], reference["params"], where, dtype)
        except AssertionError as error:
            raise AssertionError(f"{error}{_resume_hint(got['after'], reference, split)}") from None


def _resume_hint(after, reference, split):
    lr = after[0]["lr"]
    if abs(lr - reference["lrs"][0]) < 1e-12 and abs(lr - reference["lrs"][split]) > 1e-12:
        return " (the learning rate started over: save and load the schedule's state too)"
    return (" (what the next step depends on: the parameters, the optimizer's momentum buffers, the "
            "schedule's "
            "step; save them all, load them all back: get_state_dict / set_state_dict)")


# --------------------------------------------------------------------------- bytes per group (pictures)

def bytes_per_group(report, labels):
    """{group (world ranks): bytes this rank sent in the phases `labels`}, each call priced as a ring sends it
    (comm.volume.ring_bytes); scatters and broadcasts of a set-up are not in the step phases."""
    totals = {}
    for label in labels:
        for op in phase_ops(report, label):
            group = tuple(op.group or ())
            try:
                sent = ring_bytes(op)
            except ValueError:
                continue
            totals[group] = totals.get(group, 0.0) + sent
    return totals


def describe_value(value):
    return describe(value)


__all__ = ["expect_mesh", "expect_sizes_refused", "expect_block", "expect_pipeline", "expect_sharded",
           "expect_memory_sharded", "expect_samples", "expect_training", "expect_resumed", "bytes_per_group",
           "ratio_hint", "is_close"]
