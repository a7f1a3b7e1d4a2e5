"""Planted bugs for 13_gpt_in_3d: each must lose the listed cells with a message saying why.

Realistic mistakes, at least four per exercise: the mesh with dp and tp swapped (tensor-parallel groups of
ranks 4 apart), with its dims unnamed, with pp and tp in the wrong order, without the check of its sizes
(torch's init_device_mesh does not check: it builds a mesh of 6 of 8 ranks); the block's plan without the
LayerNorm in it (its gradients never summed over tp), with the dropouts outside the sequence-parallel region
(each rank draws a mask for its own piece: the tp group's masks are no pieces of one), q row-parallel, proj's
output replicated instead of split along the sequence, attention on the rank's own tokens only; a stage boundary
off by one, the stage index taken from the world rank, the pipeline on the world group, GPipe instead of 1F1B,
stages cut in equal numbers of blocks whatever their costs; fully_shard on the root only, blocks kept gathered
after forward, the same samples on every dp rank, no set_epoch, every rank taking the whole batch; clipping by
each rank's own norm (and by the stages' without summing over pp), the loss averaged over the world instead of
dp, the loss not sent to every stage, no learning-rate step, gradients never zeroed, clipping after the update;
a checkpoint saved by rank 0 only, without the optimizer, without the schedule, the optimizer's own state_dict
(keyed by parameter index, not by name). A bug lists the cell that shows it (the basic one when both would say
the same), and the cells it must keep passing.
"""

from dpgrader.planted import Bug, solution_code

ASSIGNMENT = "13_gpt_in_3d"

# the later exercises compose the earlier ones: their bugs are planted next to those solutions
SOLVED = {key: solution_code(ASSIGNMENT, key) for key in ("make_mesh", "block_plan", "pipeline_stages",
                                                          "shard_data_parallel", "train_step")}
BEFORE_STEP = {k: v for k, v in SOLVED.items() if k != "train_step"}


def _step_bug(name, patch, loses, keeps=()):
    return Bug("train_step", name, patch=patch, cells=dict(BEFORE_STEP), loses=loses, keeps=list(keeps))


def _checkpoint_bug(name, patch, loses):
    return Bug("checkpoint_3d", name, patch=patch, cells=dict(SOLVED), loses=loses)


MESH_CALL = '    return init_device_mesh(rank_device().type, (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))'
LOCAL_NORM = '''    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()                               # over this stage's dp and tp pieces
    squares = norm.double() ** 2
    dist.all_reduce(squares, group=pp.get_group())              # over the stages
    norm = squares.sqrt()
'''

BUGS = [
    # -- make_mesh ----------------------------------------------------------------------------------------
    Bug("make_mesh", "dp_and_tp_swapped",
        patch=[(MESH_CALL, '    return init_device_mesh(rank_device().type, (tp, pp, dp), '
                           'mesh_dim_names=("tp", "pp", "dp"))')],
        loses={"test_make_mesh_basic": "dp and tp are swapped"}),
    Bug("make_mesh", "dims_unnamed",
        patch=[(MESH_CALL, "    return init_device_mesh(rank_device().type, (dp, pp, tp))")],
        loses={"test_make_mesh_basic": "rank 0's mesh has dims named [], expected ['dp', 'pp', 'tp']"}),
    Bug("make_mesh", "pp_and_tp_swapped",
        patch=[(MESH_CALL, '    return init_device_mesh(rank_device().type, (dp, tp, pp), '
                           'mesh_dim_names=("dp", "tp", "pp"))')],
        loses={"test_make_mesh_basic": "pp and tp are swapped"}),
    Bug("make_mesh", "sizes_not_checked",
        patch=[("    if dp * pp * tp != world:\n", "    if False:\n")],
        loses={"test_make_mesh_layouts": "raise a ValueError when dp x pp x tp = 6 is not the world size 8"},
        keeps=["test_make_mesh_basic"]),

    # -- block_plan ---------------------------------------------------------------------------------------
    Bug("block_plan", "layer_norm_left_out",
        patch=[('        prefix + "norm1": SequenceParallel(),\n', "")],
        loses={"test_block_plan_basic": "its gradient is this rank's share, never summed over the tp group"}),
    Bug("block_plan", "dropout_outside_the_sequence_parallel_region",
        patch=[('        prefix + "drop1": SequenceParallel(use_local_output=True),\n', ""),
               ('        prefix + "drop2": SequenceParallel(use_local_output=True),\n', "")],
        loses={"test_block_plan_dropout": "the tp ranks' masks are no longer pieces of one"},
        keeps=["test_block_plan_basic"]),
    Bug("block_plan", "q_row_parallel",
        patch=[('        prefix + "attn.q": ColwiseParallel(),\n', '        prefix + "attn.q": RowwiseParallel(),\n')],
        loses={"test_block_plan_basic": "the plan's layouts must chain"}),
    Bug("block_plan", "proj_output_replicated",
        patch=[('        prefix + "attn.proj": RowwiseParallel(output_layouts=Shard(1)),\n',
                '        prefix + "attn.proj": RowwiseParallel(),\n')],
        loses={"test_block_plan_basic": "the plan's layouts must chain"}),
    Bug("block_plan", "attention_on_its_own_tokens",
        patch=[('        prefix + "attn": PrepareModuleInput(**gather),\n', "")],
        loses={"test_block_plan_basic": "the forward made 4 all_gather_into_tensor"}),

    # -- pipeline_stages ----------------------------------------------------------------------------------
    Bug("pipeline_stages", "stage_boundary_off_by_one",
        patch=[("    return stage_of(model, cuts[s], cuts[s + 1])",
                "    return stage_of(model, cuts[s], min(cuts[s + 1] + 1, len(layer_costs)))")],
        loses={"test_pipeline_stages_basic": "expected every block once"}),
    Bug("pipeline_stages", "stage_index_from_the_world_rank",
        patch=[("    s = pp_mesh.get_local_rank()\n", "    s = dist.get_rank() % len(layer_costs)\n"),
               ("    pipe = PipelineStage(stage, pp_mesh.get_local_rank(), pp_mesh.size(), rank_device(),",
                "    pipe = PipelineStage(stage, dist.get_rank() % pp_mesh.size(), pp_mesh.size(), "
                "rank_device(),")],
        loses={"test_pipeline_stages_balanced": "this rank's place on the pp dimension"}, keeps=["test_pipeline_stages_basic"]),
    Bug("pipeline_stages", "pipeline_on_the_world_group",
        patch=[("    pipe = PipelineStage(stage, pp_mesh.get_local_rank(), pp_mesh.size(), rank_device(),\n"
                "                         group=pp_mesh.get_group())",
                "    pipe = PipelineStage(stage, pp_mesh.get_local_rank(), pp_mesh.size(), rank_device())")],
        loses={"test_pipeline_stages_balanced": "group=pp_mesh.get_group()"},
        keeps=["test_pipeline_stages_basic"]),
    Bug("pipeline_stages", "gpipe_instead_of_1f1b",
        patch=[("    return Schedule1F1B(pipe, n_microbatches=n_micro, loss_fn=lm_loss)",
                "    from torch.distributed.pipelining import ScheduleGPipe\n\n"
                "    return ScheduleGPipe(pipe, n_microbatches=n_micro, loss_fn=lm_loss)")],
        loses={"test_pipeline_stages_basic": "the schedule is ScheduleGPipe, expected Schedule1F1B"}),
    Bug("pipeline_stages", "equal_blocks_whatever_the_costs",
        patch=[("    cuts = partition_layers(layer_costs, pp_mesh.size())",
                "    n, p = len(layer_costs), pp_mesh.size()\n    cuts = [i * n // p for i in range(p + "
                "1)]")],
        loses={"test_pipeline_stages_balanced": "a better cut's slowest costs 3"},
        keeps=["test_pipeline_stages_basic"]),

    # -- shard_data_parallel ------------------------------------------------------------------------------
    Bug("shard_data_parallel", "root_only",
        patch=[("    for block in stage.blocks.values():\n        fully_shard(block, mesh=dp_mesh)\n", "")],
        loses={"test_shard_data_parallel_basic": "all-gather(s) of parameters, expected 3"}),
    Bug("shard_data_parallel", "blocks_kept_gathered",
        patch=[("        fully_shard(block, mesh=dp_mesh)", "        fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)")],
        loses={"test_shard_data_parallel_basic": "the backward made 0 all-gather(s) of parameters, expected 2"}),
    Bug("shard_data_parallel", "same_samples_on_every_dp_rank",
        patch=[("num_replicas=dp_size, rank=dp_rank,", "num_replicas=1, rank=0,")],
        loses={"test_shard_data_parallel_basic": "no two dp ranks may see the same sample"}),
    Bug("shard_data_parallel", "no_set_epoch",
        patch=[("    sampler.set_epoch(epoch)\n", "")],
        loses={"test_shard_data_parallel_epochs": "(epoch 1)"}, keeps=["test_shard_data_parallel_basic"]),
    Bug("shard_data_parallel", "every_rank_takes_the_whole_batch",
        patch=[("    per_rank = batch // dp_size\n", "    per_rank = batch\n")],
        loses={"test_shard_data_parallel_basic": "expected 2 (the global batch of 4 over 2 ranks)"}),

    # -- train_step (next to the solved pieces) --------------------------------------------------------------
    _step_bug("clips_by_its_own_norm",
              patch=[(LOCAL_NORM, "    norm = torch.nn.utils.get_total_norm([p.grad for p in params])\n"
                                  "    if isinstance(norm, DTensor):\n"
                                  "        norm = norm.to_local()\n")],
              loses={"test_train_step_basic": "clip by the norm of the whole model's gradient"}),
    _step_bug("norm_not_summed_over_the_stages",
              patch=[("    dist.all_reduce(squares, group=pp.get_group())              # over the stages\n", "")],
              loses={"test_train_step_basic": "clip by the norm of the whole model's gradient"}),
    _step_bug("loss_averaged_over_the_world",
              patch=[("    dist.all_reduce(loss, group=pp.get_group())                 # only the last "
                      "stage's is not 0\n"
                      "    dist.all_reduce(loss, group=mesh[\"dp\"].get_group())\n    loss = loss / "
                      "mesh[\"dp\"].size()",
                      "    dist.all_reduce(loss)\n    loss = loss / dist.get_world_size()")],
              loses={"test_train_step_basic": "averaged over dp (not over the whole world)"}),
    _step_bug("loss_not_sent_to_every_stage",
              patch=[("    dist.all_reduce(loss, group=pp.get_group())                 # only the last "
                      "stage's is not 0\n",
                      "")],
              loses={"test_train_step_basic": "the last stage's mean of its micro-batches, sent to every stage"}),
    _step_bug("no_learning_rate_step",
              patch=[("    run.lr_schedule.step()\n", "")],
              loses={"test_train_step_basic": "step the learning-rate schedule once per step"}),
    _step_bug("gradients_never_zeroed",
              patch=[("    run.optimizer.zero_grad()\n", "")],
              loses={"test_train_step_basic": "optimizer.zero_grad() once per step"}),
    _step_bug("clips_after_the_update",
              patch=[("    torch.nn.utils.clip_grads_with_norm_(params, run.recipe.max_norm, "
                      "norm.to(params[0].grad.dtype))\n"
                      "    lr = run.lr_schedule.get_last_lr()[0]\n    run.optimizer.step()\n",
                      "    lr = run.lr_schedule.get_last_lr()[0]\n    run.optimizer.step()\n"
                      "    torch.nn.utils.clip_grads_with_norm_(params, run.recipe.max_norm, "
                      "norm.to(params[0].grad.dtype))\n")],
              loses={"test_train_step_basic": "before optimizer.step()"}),

    # -- checkpoint_3d (next to the solved pieces and step) ----------------------------------------------------
    _checkpoint_bug("saved_by_rank_0_only",
                    patch=[("    dcp.save({", "    if dist.get_rank() == 0:\n        dcp.save({"),
                           ("             checkpoint_id=folder)", "                 checkpoint_id=folder)")],
                    loses={"test_checkpoint_3d_resume": "waited in vain for their peers"}),
    _checkpoint_bug("optimizer_not_saved",
                    patch=[('    dcp.save({"model": model_state, "optim": optim_state, "schedule"',
                            '    dcp.save({"model": model_state, "schedule"'),
                           ('    state = {"model": model_state, "optim": optim_state, "schedule"',
                            '    state = {"model": model_state, "schedule"'),
                           ('optim_state_dict=state["optim"])', "optim_state_dict=optim_state)")],
                    loses={"test_checkpoint_3d_resume": "the optimizer's momentum buffers"}),
    _checkpoint_bug("schedule_not_saved",
                    patch=[('    run.lr_schedule.load_state_dict(state["schedule"])\n', "")],
                    loses={"test_checkpoint_3d_resume": "the learning rate started over"}),
    _checkpoint_bug("optimizer_state_by_parameter_index",
                    patch=[('    dcp.save({"model": model_state, "optim": optim_state, "schedule"',
                            '    dcp.save({"model": model_state, "optim": run.optimizer.state_dict(), "schedule"'),
                           ('    state = {"model": model_state, "optim": optim_state, "schedule"',
                            '    state = {"model": model_state, "optim": run.optimizer.state_dict(), "schedule"'),
                           ('    set_state_dict(run.stage, run.optimizer, model_state_dict=state["model"], '
                            'optim_state_dict=state["optim"])',
                            '    set_state_dict(run.stage, run.optimizer, model_state_dict=state["model"], '
                            'optim_state_dict=optim_state)\n    run.optimizer.load_state_dict(state["optim"])')],
                    loses={"test_checkpoint_3d_resume": "an optimizer's own state_dict() numbers its parameters"}),
]
