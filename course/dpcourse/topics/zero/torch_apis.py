"""torch's own ZeRO: `ZeroRedundancyOptimizer` (ZeRO-1) and `fully_shard` (FSDP2, ZeRO-3), inside a rank,
on the runs of dpcourse.topics.zero.runs, so notebook 10 can put them next to yours.

What they do (torch 2.13, read from the installed source):
  * torch/distributed/optim/zero_redundancy_optimizer.py: `ZeroRedundancyOptimizer(params,
    optimizer_class, **defaults)` assigns *whole parameters* to ranks (`_partition_parameters`:
    sorted by numel, largest first, each to the rank with the fewest elements so far), builds
    the local optimizer over this rank's parameters only, and after its `step()` every rank
    `broadcast`s the parameters it owns (`_sync_params`, one broadcast per parameter unless
    parameters_as_bucket_view=True). It does not touch gradients: DDP averages them first.
  * torch/distributed/fsdp/_fully_shard/: `fully_shard(module)` turns each parameter into a
    DTensor sharded on dim 0 (`torch.chunk` rule, padded to equal chunks: _fsdp_param.py), one
    group per call; a forward pre-hook all-gathers the group's parameters in one collective
    (`all_gather_single`), a forward hook frees them if `reshard_after_forward` (default: True,
    except for the root module), backward all-gathers them again, and after the group's
    gradients are computed they are reduce-scattered (`reduce_scatter_single`, float64 with a
    SUM and a division by N: _fsdp_collectives.py `_get_gradient_divide_factors`) and the
    unsharded ones freed. In backward FSDP2 prefetches the next group's all-gather before the
    current group's reduce-scatter: at most two groups unsharded at once.
"""

import torch
import torch.distributed as dist

from dpcourse.backend import rank_device
from dpcourse.comm.cases import splits
from dpcourse.reference.gradients import state_of
from dpcourse.topics.zero.memory import optimizer_summary
from dpcourse.topics.zero.runs import (
    LR,
    _fsdp_case,
    _on_device,
    _zero1_case,
    build_model,
    flat_parameters,
    fsdp_run,
    global_gradient,
)
from dpcourse.toys.models import loss_fn


@splits(_zero1_case)
def zero_redundancy_run(_, batches, ctx):
    """runs.zero1_run with torch's ZeroRedundancyOptimizer(AdamW), the same scaffolding (the averaged
    gradient from the whole global batch): launch_run(zero_redundancy_run, N, None, model, seed, steps,
    per_rank). Adds "owned": the names of the parameters this rank's local optimizer steps."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    net = build_model(ctx.shared["model"], ctx.shared["seed"], rank_device())
    opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    for xb, yb in _on_device(batches):
        opt.zero_grad()
        global_gradient(net, xb, yb)
        opt.step()
    names = {p: name for name, p in net.named_parameters()}
    owned = [names[p] for group in opt.optim.param_groups for p in group["params"]]
    return {"state": state_of(net), "optimizer": optimizer_summary(opt.optim, list(net.parameters())),
            "owned": owned}


def shard_children(net, reshard_after_forward=True):
    """fully_shard every child with trainable parameters (one group each), then the root: the
    bottom-up order FSDP2's documentation asks for."""
    from torch.distributed.fsdp import fully_shard

    for child in net.children():
        if any(p.requires_grad for p in child.parameters()):
            fully_shard(child, reshard_after_forward=reshard_after_forward)
    fully_shard(net)
    return net


@splits(_fsdp_case)
def fully_shard_run(_, batches, ctx):
    """runs.fsdp_run with torch's fully_shard: launch_run(fully_shard_run, N, None, model, seed, steps,
    per_rank). Returns {"params": the flat trainable parameters after training (gathered), "local":
    {name: this rank's shard shape}}; launch_run adds "ops" (the whole run's calls)."""
    net = shard_children(build_model(ctx.shared["model"], ctx.shared["seed"], rank_device()))
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    for xb, yb in _on_device(batches):
        opt.zero_grad()
        loss_fn(net(xb), yb).backward()
        opt.step()
    local = {name: tuple(p.to_local().shape) for name, p in net.named_parameters()}
    return {"params": flat_parameters(net), "local": local}


@splits(_fsdp_case)
def mini_fsdp_params(MiniFSDP, batches, ctx):
    """Your MiniFSDP on the same run, its shards gathered into the flat parameters (to compare)."""
    result = fsdp_run(MiniFSDP, batches, ctx)
    gathered = []
    for shard in result["shards"]:
        pieces = [None] * dist.get_world_size()
        dist.all_gather_object(pieces, shard.cpu())
        gathered.append(torch.cat(pieces))
    result["params"] = torch.cat(gathered)
    return result
