"""Planted bugs for 09_hybrid_parallelism: each must lose the listed cells with a message saying why.

At least four per exercise. The grid: groups created in a different order on some ranks, only the
groups a rank belongs to, dp and tp swapped in the rank -> coordinate map, a wrong pipeline
coordinate, no ValueError for a grid that does not fit, none for a grid smaller than the world,
no group (None) for an axis of size 1. Data x tensor: gradients averaged over the tp group (the
wrong group), over the whole world, over dp *and* tp, summed instead of averaged, rows sliced by
world rank, gradients never cleared, the loss returned as a tensor, the loss all-reduced over dp. Data x pipeline: the stage's
neighbours taken as ranks 0 .. pp - 1, the stage index from the dp coordinate, gradients averaged
over the pipeline, summed, rows sliced by stage. The planner: memory ignored, only one micro-batch,
the first layout that fits, a refusal that names no memory, stages checked against the batch
instead of the layers, a tp that does not divide the hidden size or the heads.
"""

from dpgrader.planted import Bug

ORDER = "every rank must create every group in the same order, or it hangs"

# --------------------------------------------------------------------------- make_grid_groups

GROUPS_IN_ANOTHER_ORDER_ON_ODD_RANKS = Bug(
    "make_grid_groups", "groups_in_another_order_on_odd_ranks",
    patch=[("    for axis in AXES:                       # the same order on every rank\n",
            "    for axis in (AXES if rank % 2 == 0 else AXES[::-1]):\n")],
    loses={"test_make_grid_groups_basic": ORDER, "test_make_grid_groups_shapes": ORDER})

ONLY_ITS_OWN_GROUPS = Bug(
    "make_grid_groups", "only_its_own_groups",
    patch=[("            group = dist.new_group(members)  # every rank creates every group\n"
            "            if rank in members:\n                groups[axis] = group\n",
            "            if rank in members:\n                groups[axis] = dist.new_group(members)\n")],
    loses={"test_make_grid_groups_basic": ORDER})

DP_AND_TP_SWAPPED = Bug(
    "make_grid_groups", "dp_and_tp_swapped",
    patch=[("    mesh = torch.arange(world).view(dp, pp, tp)\n",
            "    mesh = torch.arange(world).view(tp, pp, dp).permute(2, 1, 0)   # dp varies fastest\n"),
           ('    coords = {"dp": rank // (pp * tp), "pp": rank // tp % pp, "tp": rank % tp}',
            '    coords = {"dp": rank % dp, "pp": rank // dp % pp, "tp": rank // (dp * pp)}')],
    loses={"test_make_grid_groups_basic": "dp and tp are swapped",
           "test_make_grid_groups_shapes": "dp and tp are swapped"})

PP_AND_TP_SWAPPED = Bug(  # pp varies fastest: a 2-D grid (pp = 1) is right, a 3-D one is not
    "make_grid_groups", "pp_and_tp_swapped",
    patch=[("    mesh = torch.arange(world).view(dp, pp, tp)\n",
            "    mesh = torch.arange(world).view(dp, tp, pp).permute(0, 2, 1)   # pp varies fastest\n"),
           ('    coords = {"dp": rank // (pp * tp), "pp": rank // tp % pp, "tp": rank % tp}',
            '    coords = {"dp": rank // (pp * tp), "pp": rank % pp, "tp": rank // pp % tp}')],
    loses={"test_make_grid_groups_shapes": "pp and tp are swapped"},
    keeps=["test_make_grid_groups_basic"])

DP_LINES_SPAN_THE_PIPELINE = Bug(  # every rank of the same tp slice, whatever its stage: right when pp = 1
    "make_grid_groups", "dp_lines_span_the_pipeline",
    patch=[('    lines = {"dp": [mesh[:, p, t] for p in range(pp) for t in range(tp)],',
            '    lines = {"dp": [mesh[:, :, t].flatten() for t in range(tp)],')],
    loses={"test_make_grid_groups_shapes": "the dp group spans the pipeline stages too"},
    keeps=["test_make_grid_groups_basic"])

PIPELINE_COORDINATE_WITHOUT_MODULO = Bug(
    "make_grid_groups", "pipeline_coordinate_without_modulo",
    patch=[('"pp": rank // tp % pp', '"pp": rank // tp')],
    loses={"test_make_grid_groups_basic": "rank 2's coordinates are",
           "test_make_grid_groups_shapes": "coordinates are"})

SMALLER_GRID_ACCEPTED = Bug(  # refuses only a grid larger than the world: ranks 2, 3 of dp 1 x tp 2 have no place
    "make_grid_groups", "smaller_grid_accepted",
    patch=[("    if dp * pp * tp != world:\n", "    if dp * pp * tp > world:\n"),
           ("    mesh = torch.arange(world).view(dp, pp, tp)\n", "    mesh = torch.arange(dp * pp * tp).view(dp, pp, tp)\n")],
    loses={"test_make_grid_groups_shapes": "smaller than the world size 4"},
    keeps=["test_make_grid_groups_basic"])

SIZE_ONE_AXIS_WITHOUT_A_GROUP = Bug(  # None for an axis of one rank: the pp axis of a 2-D grid
    "make_grid_groups", "size_one_axis_without_a_group",
    patch=[("            group = dist.new_group(members)  # every rank creates every group\n",
            "            group = dist.new_group(members) if len(members) > 1 else None\n")],
    loses={"test_make_grid_groups_basic": "grid.groups['pp'] is None",
           "test_make_grid_groups_shapes": "still needs a process group"})

NO_VALUE_ERROR = Bug(
    "make_grid_groups", "no_value_error",
    patch=[("    if dp * pp * tp != world:\n        raise ValueError(", "    if False:\n        raise "
                                                                        "ValueError(")],
    loses={"test_make_grid_groups_shapes": "expected a ValueError"},
    keeps=["test_make_grid_groups_basic"])

# --------------------------------------------------------------------------- hybrid_dp_tp_step

TP_STEP = "hybrid_dp_tp_step"
NOT_OVER_TP = "parameter gradients are not all-reduced over tp"

AVERAGED_OVER_TP = Bug(
    TP_STEP, "averaged_over_tp",
    patch=[('dist.all_reduce(p.grad, group=grid.groups["dp"])\n            p -= lr * p.grad / dp',
            'dist.all_reduce(p.grad, group=grid.groups["tp"])\n            p -= lr * p.grad / dp')],
    loses={"test_hybrid_dp_tp_step_basic": NOT_OVER_TP, "test_hybrid_dp_tp_step_training": NOT_OVER_TP})

AVERAGED_OVER_THE_WORLD = Bug(
    TP_STEP, "averaged_over_the_world",
    patch=[('dist.all_reduce(p.grad, group=grid.groups["dp"])', "dist.all_reduce(p.grad)")],
    loses={"test_hybrid_dp_tp_step_basic": "outside its groups (tp (0, 1), dp (0, 2)) -- the whole world"})

TP_GRADIENTS_ALSO_ALL_REDUCED_OVER_TP = Bug(
    TP_STEP, "tp_gradients_also_all_reduced_over_tp",
    patch=[('            dist.all_reduce(p.grad, group=grid.groups["dp"])\n',
            '            dist.all_reduce(p.grad, group=grid.groups["dp"])\n'
            '            dist.all_reduce(p.grad, group=grid.groups["tp"])\n'
            '            p.grad /= grid.sizes["tp"]\n')],
    loses={"test_hybrid_dp_tp_step_training": NOT_OVER_TP})

SUMMED_NOT_AVERAGED = Bug(
    TP_STEP, "replica_summed_not_averaged",
    patch=[("            p -= lr * p.grad / dp\n", "            p -= lr * p.grad\n")],
    loses={"test_hybrid_dp_tp_step_basic": "the update is 2x the expected values"})

ROWS_BY_WORLD_RANK = Bug(
    TP_STEP, "rows_by_world_rank",
    patch=[("    x, y = batch.tensor_split(dp)[replica], targets.tensor_split(dp)[replica]   # same rows on "
            "the tp group",
            "    world, rank = dist.get_world_size(), dist.get_rank()\n"
            "    x, y = batch.tensor_split(world)[rank], targets.tensor_split(world)[rank]")],
    loses={"test_hybrid_dp_tp_step_basic": "the same rows on every rank of the replica"})

LOSS_RETURNED_AS_A_TENSOR = Bug(
    TP_STEP, "loss_returned_as_a_tensor",
    patch=[("    return loss.item()\n", "    return loss\n")],
    loses={"test_hybrid_dp_tp_step_basic": "expected a Python float",
           "test_hybrid_dp_tp_step_training": "return loss.item()"})

LOSS_ALL_REDUCED_OVER_DP = Bug(  # the whole batch's loss: 8 more bytes on the dp group, and the wrong loss
    TP_STEP, "loss_all_reduced_over_dp",
    patch=[("    return loss.item()\n",
            "    total = loss.detach().clone()\n"
            "    dist.all_reduce(total, group=grid.groups[\"dp\"])\n"
            "    return total.item() / dp\n")],
    loses={"test_hybrid_dp_tp_step_basic": "a single value, the loss?",
           "test_hybrid_dp_tp_step_training": "its only communication is the gradients' all-reduces"})

GRADIENTS_NOT_CLEARED = Bug(
    TP_STEP, "gradients_not_cleared",
    patch=[("            p -= lr * p.grad / dp\n            p.grad = None\n    return loss.item()",
            "            p -= lr * p.grad / dp\n    return loss.item()")],
    loses={"test_hybrid_dp_tp_step_basic": "the previous step's gradient was added in again"})

# --------------------------------------------------------------------------- hybrid_dp_pp_step

PP_STEP = "hybrid_dp_pp_step"

NEIGHBOURS_BY_POSITION = Bug(
    PP_STEP, "neighbours_by_position",
    patch=[('make_stage(model, cuts, grid.coords["pp"], ranks=grid.members("pp"))',
            'make_stage(model, cuts, grid.coords["pp"])')],
    loses={"test_hybrid_dp_pp_step_basic": "outside its pipeline (2, 3)"})

STAGE_INDEX_FROM_DP = Bug(
    PP_STEP, "stage_index_from_dp",
    patch=[('make_stage(model, cuts, grid.coords["pp"], ranks=grid.members("pp"))',
            'make_stage(model, cuts, grid.coords["dp"], ranks=grid.members("pp"))')],
    loses={"test_hybrid_dp_pp_step_basic": "grid.coords['pp']"})

AVERAGED_OVER_THE_PIPELINE = Bug(
    PP_STEP, "averaged_over_the_pipeline",
    patch=[('            dist.all_reduce(p.grad, group=grid.groups["dp"])\n'
            '            p -= lr * p.grad / dp\n            p.grad = None\n    return loss\n',
            '            dist.all_reduce(p.grad, group=grid.groups["pp"])\n'
            '            p -= lr * p.grad / dp\n            p.grad = None\n    return loss\n')],
    loses={"test_hybrid_dp_pp_step_basic": "that is its pp group"})

PIPELINE_SUMMED_NOT_AVERAGED = Bug(
    PP_STEP, "pipeline_summed_not_averaged",
    patch=[("            p -= lr * p.grad / dp\n            p.grad = None\n    return loss\n",
            "            p -= lr * p.grad\n            p.grad = None\n    return loss\n")],
    loses={"test_hybrid_dp_pp_step_basic": "the update is 2x the expected values",
           "test_hybrid_dp_pp_step_training": "the update is 2x the expected values"})

ROWS_BY_STAGE = Bug(
    PP_STEP, "rows_by_stage",
    patch=[('    dp, replica = grid.sizes["dp"], grid.coords["dp"]\n'
            '    x, y = batch.tensor_split(dp)[replica], targets.tensor_split(dp)[replica]\n'
            '    loss = pipeline_step',
            '    dp, replica = grid.sizes["dp"], grid.coords["pp"]\n'
            '    x, y = batch.tensor_split(dp)[replica], targets.tensor_split(dp)[replica]\n'
            '    loss = pipeline_step')],
    loses={"test_hybrid_dp_pp_step_basic": "the same rows on every rank of the replica"})

# --------------------------------------------------------------------------- plan

MEMORY_IGNORED = Bug(
    "plan", "memory_ignored",
    patch=[('if p["memory"] <= cluster["memory"] and (best is None', 'if (best is None')],
    loses={"test_plan_basic": "more than the 6 GB the GPUs have",
           "test_plan_limits": "it should raise a ValueError"})

ONE_MICRO_BATCH_ONLY = Bug(
    "plan", "one_micro_batch_only",
    patch=[('for micro in divisors(model["batch"] // dp):', "for micro in (1,):")],
    loses={"test_plan_basic": "fits (3.10 GB per GPU of 6 GB): try every"})

FIRST_LAYOUT_THAT_FITS = Bug(
    "plan", "first_layout_that_fits",
    patch=[('(best is None or p["time"] < best["time"])', "best is None")],
    loses={"test_plan_basic": "try every dp, tp, pp and micro-batch count"})

REFUSAL_WITHOUT_THE_MEMORY = Bug(
    "plan", "refusal_without_the_memory",
    patch=[("    if best is None:\n        raise ValueError(",
            "    if best is None:\n        raise ValueError(\"the model does not fit on this cluster\")\n"
            "        raise ValueError(")],
    loses={"test_plan_limits": "the message should name the smallest memory per GPU"},
    keeps=["test_plan_basic"])

STAGES_CHECKED_AGAINST_THE_BATCH = Bug(
    "plan", "stages_checked_against_the_batch",
    patch=[('if model["layers"] % pp or model["batch"] % dp or',
            'if model["batch"] % pp or model["batch"] % dp or')],
    loses={"test_plan_limits": "do not split evenly into"},
    keeps=["test_plan_basic"])

TP_NOT_CHECKED_AGAINST_THE_FEATURES = Bug(  # tp 3 of 6 GPUs does not divide 1024 features: predict refuses
    "plan", "tp_not_checked_against_the_features",
    patch=[(' or model["hidden"] % tp or model["heads"] % tp:', ":")],
    loses={"test_plan_limits": "does not split evenly over tp 3"},
    keeps=["test_plan_basic"])

BUGS = [GROUPS_IN_ANOTHER_ORDER_ON_ODD_RANKS, ONLY_ITS_OWN_GROUPS, DP_AND_TP_SWAPPED, PP_AND_TP_SWAPPED,
        DP_LINES_SPAN_THE_PIPELINE,
        PIPELINE_COORDINATE_WITHOUT_MODULO, NO_VALUE_ERROR, SMALLER_GRID_ACCEPTED, SIZE_ONE_AXIS_WITHOUT_A_GROUP,
        AVERAGED_OVER_TP, AVERAGED_OVER_THE_WORLD, TP_GRADIENTS_ALSO_ALL_REDUCED_OVER_TP, SUMMED_NOT_AVERAGED,
        ROWS_BY_WORLD_RANK, GRADIENTS_NOT_CLEARED, LOSS_RETURNED_AS_A_TENSOR, LOSS_ALL_REDUCED_OVER_DP,
        NEIGHBOURS_BY_POSITION, STAGE_INDEX_FROM_DP, AVERAGED_OVER_THE_PIPELINE, PIPELINE_SUMMED_NOT_AVERAGED,
        ROWS_BY_STAGE,
        MEMORY_IGNORED, ONE_MICRO_BATCH_ONLY, FIRST_LAYOUT_THAT_FITS, REFUSAL_WITHOUT_THE_MEMORY,
        STAGES_CHECKED_AGAINST_THE_BATCH, TP_NOT_CHECKED_AGAINST_THE_FEATURES]
