"""The hidden checks of 13_gpt_in_3d pass the notebook's own solutions (dpgrader.gpt_in_3d.tuned), and fail
implementations with the mistakes they exist for: clipping by a rank's own norm, a LayerNorm left out of the
tensor-parallel plan, a stage index taken from the world rank."""

import pytest
import torch
import torch.distributed as dist

from dpgrader.gpt_in_3d import tuned
from dpgrader.gpt_in_3d.checks import (
    check_block_plan,
    check_checkpoint_3d,
    check_make_mesh,
    check_pipeline_stages,
    check_shard_data_parallel,
    check_train_step,
)
from markers import exercise


@exercise("make_mesh", "block_plan", "pipeline_stages", "shard_data_parallel")
def test_the_solutions_pass_the_hidden_checks_of_the_pieces():
    check_make_mesh(tuned.make_mesh)
    check_block_plan(tuned.block_plan)
    check_pipeline_stages(tuned.cut_stage, tuned.make_schedule)
    check_shard_data_parallel(tuned.apply_fsdp, tuned.dp_samples)


@exercise("train_step", "checkpoint_3d")
def test_the_solutions_pass_the_hidden_checks_of_the_step_and_the_checkpoint():
    check_train_step(tuned.PIECES)
    check_checkpoint_3d(tuned.PIECES)


def clipped_by_its_own_norm(run, inputs, targets):
    """The solution's step, but each rank clips by the norm of its own pieces of the gradient."""
    pp = run.mesh["pp"]
    first, last = pp.get_local_rank() == 0, pp.get_local_rank() == pp.size() - 1
    losses = []
    if first and last:
        run.schedule.step(inputs, target=targets, losses=losses)
    elif first:
        run.schedule.step(inputs)
    elif last:
        run.schedule.step(target=targets, losses=losses)
    else:
        run.schedule.step()
    loss = torch.stack(losses).mean().detach().double() if last else torch.zeros((), dtype=torch.float64)
    dist.all_reduce(loss, group=pp.get_group())
    dist.all_reduce(loss, group=run.mesh["dp"].get_group())
    params = [p for p in run.stage.parameters() if p.grad is not None]
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params]
    norm = torch.nn.utils.get_total_norm(grads)
    torch.nn.utils.clip_grads_with_norm_(params, run.recipe.max_norm, norm)
    lr = run.lr_schedule.get_last_lr()[0]
    run.optimizer.step()
    run.lr_schedule.step()
    run.optimizer.zero_grad()
    return {"loss": loss.item() / run.mesh["dp"].size(), "norm": norm.item(), "lr": lr}


@exercise("train_step")
def test_clipping_by_a_ranks_own_norm_is_named():
    with pytest.raises(AssertionError, match="clip by the norm of the whole model's gradient"):
        check_train_step(dict(tuned.PIECES, train_step=clipped_by_its_own_norm))


def plan_without_layer_norms(prefix=""):
    plan = tuned.block_plan(prefix)
    for name in ("norm1", "norm2"):
        del plan[prefix + name]
    return plan


@exercise("block_plan")
def test_a_layer_norm_left_out_of_the_plan_is_named():
    with pytest.raises(AssertionError, match="never summed over the tp group"):
        check_block_plan(plan_without_layer_norms)


def stage_by_world_rank(model, pp_mesh, layer_costs):
    from dpcourse.toys.gpt import stage_of

    cuts = tuned.partition_layers(layer_costs, pp_mesh.size())
    s = min(dist.get_rank(), pp_mesh.size() - 1)  # right when the pipeline is the world, not in a 2 x 2 grid
    return stage_of(model, cuts[s], cuts[s + 1])


@exercise("pipeline_stages")
def test_a_stage_taken_by_world_rank_fails_in_a_grid():
    with pytest.raises(AssertionError):
        check_pipeline_stages(stage_by_world_rank, tuned.make_schedule)
