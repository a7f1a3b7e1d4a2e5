"""Which slice of a full weight each rank of a tensor-parallel group holds.

    column_shard(full.weight, rank=1, world_size=4)   # rows 1·out/4 ... 2·out/4 of the (out, in) weight
    row_shard(full.weight, rank=1, world_size=4)      # columns 1·in/4 ... 2·in/4

nn.Linear computes y = x·Wᵀ + b with W of shape (out_features, in_features). Megatron-LM
writes the same layer Y = X·A with A = Wᵀ, and names its two splits after A:
  * column-parallel: A split by columns = W split by *rows* (output features): rank r computes
    the output features r·out/N ... (r+1)·out/N, and holds that slice of the bias;
  * row-parallel: A split by rows = W split by *columns* (input features): rank r multiplies
    its slice of the input features, and the N partial results are summed.
torch's ColwiseParallel does the same (`distribute_tensor(weight, mesh, [Shard(0)])`, its
comment: "weight would become Shard(1)" of Wᵀ), RowwiseParallel shards W on dim 1.

Test cells (notebook 08) use these to cut the expected per-rank gradients out of the full
float64 gradient; the pictures use `locate_slices` to find, in the full weight, the slice a
learner's rank actually holds. Here, below the topics, because notebooks 08, 09 and 12 cut weights
the same way (dpcourse.checks.tensors, topics.hybrid, topics.sequence).
"""

import torch


def shard_bounds(size, rank, world_size, what="dimension"):
    """(start, stop) of rank's equal slice of `size`; a clear error when N does not divide it."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not a rank of a group of {world_size}")
    if size % world_size:
        raise ValueError(f"{what} of size {size} cannot be split evenly over {world_size} ranks")
    step = size // world_size
    return rank * step, (rank + 1) * step


def column_shard(tensor, rank, world_size):
    """Rank's slice of a column-parallel layer's weight (rows) or bias: dim 0."""
    start, stop = shard_bounds(tensor.shape[0], rank, world_size, "the output features")
    return tensor[start:stop]


def row_shard(tensor, rank, world_size):
    """Rank's slice of a row-parallel layer's weight (columns), or of its input (last dim)."""
    start, stop = shard_bounds(tensor.shape[-1], rank, world_size, "the input features")
    return tensor[..., start:stop]


def locate_slices(local, full, dim):
    """Which indices of `full` along `dim` the local tensor holds, matching by value; None if it is
    not a set of whole slices of `full` (a scaled, transposed or mixed-up weight)."""
    if local is None or local.dim() != full.dim() or local.shape[dim] == 0:
        return None
    full_slices = full.detach().cpu().double().movedim(dim, 0)
    local_slices = local.detach().cpu().double().movedim(dim, 0)
    if local_slices.shape[1:] != full_slices.shape[1:]:
        return None
    found = []
    for piece in local_slices:
        matches = [i for i, candidate in enumerate(full_slices) if torch.equal(candidate, piece)]
        if not matches:
            return None
        found.append(next((i for i in matches if i not in found), matches[0]))
    return found


def shard(tensor, layout, rank, world_size):
    """Rank's piece of a tensor of a given layout: "column" (dim 0), "row" or "parallel" (the last dim),
    or the whole tensor ("replicated")."""
    if layout == "column":
        return column_shard(tensor, rank, world_size)
    if layout in ("row", "parallel"):
        return row_shard(tensor, rank, world_size)
    return tensor
