"""The instructor's hybrid steps (notebook 09): what `make bench` races, and what the library tests use.

    grid = make_grid_groups(2, 2)          # a dpcourse Grid, groups by new_subgroups_by_enumeration
    dp_tp_step(model, grid, batch, targets, loss_fn, lr)               # one bucketed all-reduce over dp
    dp_pp_step(model, cuts, grid, batch, targets, loss_fn, n_micro, lr, pipeline_step)

Two versions of each step: `plain_*`, the notebook's solution read from solutions/09 (one
all-reduce per parameter),
and the tuned one, which flattens all of a rank's gradients into one buffer and all-reduces it
once over the dp group (DDP's bucketing of notebook 05 with a single bucket), dividing by dp
in the same pass. Same arithmetic, far fewer calls: on gloo each call costs hundreds of
microseconds here, and a model of 20 parameter tensors pays it 20 times.
"""

from functools import partial

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from dpcourse.topics.hybrid.grid import AXES, Grid, check_sizes, layout
from dpcourse.topics.pipeline.stages import make_stage
from dpgrader.solutions import solution_functions


def make_grid_groups(dp, tp, pp=1):
    """Every axis' groups with dist.new_subgroups_by_enumeration, in the order dp, pp, tp."""
    check_sizes(dp, pp, tp, dist.get_world_size())
    mesh, rank = layout(dp, pp, tp), dist.get_rank()
    groups = {}
    for dim, axis in enumerate(AXES):
        lines = [line.tolist() for line in mesh.movedim(dim, -1).reshape(-1, mesh.shape[dim])]
        groups[axis] = dist.new_subgroups_by_enumeration(lines)[0]
    position = [int(i) for i in (mesh == rank).nonzero()[0]]
    coords = dict(zip(AXES, position, strict=True))
    return Grid(sizes={"dp": dp, "pp": pp, "tp": tp}, coords=coords, groups=groups)


def _replica_rows(grid, batch, targets):
    dp, replica = grid.sizes["dp"], grid.coords["dp"]
    return batch.tensor_split(dp)[replica], targets.tensor_split(dp)[replica]


def _averaged_sgd(params, grid, lr):
    """One all-reduce of every gradient, flattened, over dp; then p -= lr * mean gradient."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return
    dp = grid.sizes["dp"]
    with torch.no_grad():
        flat = _flatten_dense_tensors([p.grad for p in params])
        if dp > 1:
            dist.all_reduce(flat, group=grid.groups["dp"])
        flat.mul_(lr / dp)
        for p, g in zip(params, _unflatten_dense_tensors(flat, [p.grad for p in params]), strict=True):
            p.sub_(g)
            p.grad = None


def _tp_step(average, model, grid, batch, targets, loss_fn, lr):
    x, y = _replica_rows(grid, batch, targets)
    loss = loss_fn(model(x), y)
    loss.backward()
    average(model.parameters(), grid, lr)
    return loss.item()


def _pp_step(average, model, cuts, grid, batch, targets, loss_fn, n_micro, lr, pipeline_step):
    stage = make_stage(model, cuts, grid.coords["pp"], ranks=grid.members("pp"))
    x, y = _replica_rows(grid, batch, targets)
    loss = pipeline_step(stage, x, y, loss_fn, n_micro)
    average(stage.module.parameters(), grid, lr)
    return loss


# tuned: the gradients averaged over dp in one flattened all-reduce
dp_tp_step = partial(_tp_step, _averaged_sgd)
dp_pp_step = partial(_pp_step, _averaged_sgd)


# the notebook's solution, read from solutions/09 (one all-reduce per parameter)
plain_dp_tp_step, plain_dp_pp_step = solution_functions("09_hybrid_parallelism", "hybrid_dp_tp_step",
                                                        "hybrid_dp_pp_step")


# exercise key -> its tuned version here (autograder/exercises.json lists it; a test imports each)
TUNED = {
    "make_grid_groups": "make_grid_groups",
    "hybrid_dp_tp_step": "dp_tp_step",
    "hybrid_dp_pp_step": "dp_pp_step",
}
