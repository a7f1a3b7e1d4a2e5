"""The course's tensor-parallel layers, on a 1-D DeviceMesh: what notebook 09 builds its hybrid on.

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    block = TensorParallelMLP(mlp(d_model=8, d_hidden=32, seed=0), mesh["tp"])
    y = block(x)        # x and y replicated over the tp ranks; one all-reduce forward, one backward
    [p.shape for p in block.parameters()]    # plain tensors: this rank's slices

Notebook 08 has you write these layers from autograd.Functions over a process group. This
version is written another way, with DTensor *placements*, the way torch's ColwiseParallel
and RowwiseParallel place their communication, so that it documents the layers without
handing out the exercises:
  * f is `DTensor.from_local(x, mesh, [Replicate()]).to_local(grad_placements=[Partial()])`:
    nothing happens forward; backward, the gradient is declared a per-rank partial sum, and
    from_local's backward turns Partial into Replicate -- an all-reduce;
  * g is `DTensor.from_local(x, mesh, [Partial()]).redistribute(mesh, [Replicate()])`: an
    all-reduce forward; backward the replicated gradient passes through (a Replicate gradient
    of a Partial tensor needs no communication);
  * each rank's slice of a full weight comes from `distribute_tensor(w, mesh, [Shard(d)],
    src_data_rank=None)`: every rank cuts its own piece, nothing is sent.
The parameters are plain tensors (the local slices), so a data-parallel wrapper can all-reduce
their gradients over another group (notebook 09). The layers have the same contracts as
notebook 08's exercises: ColumnParallelLinear(linear, mesh, gather_output=False),
RowParallelLinear(linear, mesh, input_is_parallel=True), TensorParallelMLP(mlp, mesh),
TensorParallelAttention(attention, mesh), built from the unsharded modules of `models`.
"""

import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from dpcourse.topics.tensor.models import attend


def _check_mesh(mesh):
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise TypeError(f"expected a 1-D DeviceMesh (e.g. init_device_mesh(...)['tp']), got {mesh!r}")
    return mesh


def identity_forward_all_reduce_backward(x, mesh):
    """f: x unchanged; its gradient summed over the mesh in backward."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def all_reduce_forward_identity_backward(x, mesh):
    """g: the sum of x over the mesh; the gradient passes back unchanged."""
    partial = DTensor.from_local(x, mesh, [Partial()], run_check=False)
    return partial.redistribute(mesh, [Replicate()]).to_local()


def gather_last_dim(x, mesh):
    """The slices of every rank side by side (last dimension); backward keeps this rank's slice."""
    return DTensor.from_local(x, mesh, [Shard(x.dim() - 1)], run_check=False).redistribute(
        mesh, [Replicate()]).to_local()


def split_last_dim(x, mesh):
    """This rank's slice of a replicated x (last dimension); backward gathers the slices' gradients."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(
        mesh, [Shard(x.dim() - 1)]).to_local()


def _local_slice(tensor, mesh, dim):
    if tensor.shape[dim] % mesh.size():
        raise ValueError(f"a dimension of size {tensor.shape[dim]} cannot be split evenly over "
                         f"{mesh.size()} ranks")
    return nn.Parameter(distribute_tensor(tensor.detach(), mesh, [Shard(dim)], src_data_rank=None)
                        .to_local().clone())


class ColumnParallelLinear(nn.Module):
    """y = x·Wᵀ + b with W's rows (output features) split over the mesh; x replicated."""

    def __init__(self, linear, mesh, gather_output=False):
        super().__init__()
        self.mesh, self.gather_output = _check_mesh(mesh), gather_output
        self.weight = _local_slice(linear.weight, mesh, 0)
        self.bias = None if linear.bias is None else _local_slice(linear.bias, mesh, 0)

    def forward(self, x):
        y = F.linear(identity_forward_all_reduce_backward(x, self.mesh), self.weight, self.bias)
        return gather_last_dim(y, self.mesh) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = x·Wᵀ + b with W's columns (input features) split over the mesh; y replicated."""

    def __init__(self, linear, mesh, input_is_parallel=True):
        super().__init__()
        self.mesh, self.input_is_parallel = _check_mesh(mesh), input_is_parallel
        self.weight = _local_slice(linear.weight, mesh, 1)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):
        if not self.input_is_parallel:
            x = split_last_dim(x, self.mesh)
        y = all_reduce_forward_identity_backward(F.linear(x, self.weight), self.mesh)
        return y if self.bias is None else y + self.bias


class TensorParallelMLP(nn.Module):
    """The transformer MLP with fc1 column-parallel and fc2 row-parallel."""

    def __init__(self, mlp, mesh):
        super().__init__()
        self.fc1 = ColumnParallelLinear(mlp.fc1, mesh)
        self.act = nn.GELU()
        self.fc2 = RowParallelLinear(mlp.fc2, mesh)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class TensorParallelAttention(nn.Module):
    """Self-attention split by heads: qkv column-parallel, proj row-parallel."""

    def __init__(self, attention, mesh):
        super().__init__()
        if attention.n_heads % _check_mesh(mesh).size():
            raise ValueError(f"{attention.n_heads} heads cannot be split evenly over {mesh.size()} ranks")
        self.heads = attention.n_heads // mesh.size()
        self.qkv = ColumnParallelLinear(attention.qkv, mesh)
        self.proj = RowParallelLinear(attention.proj, mesh)

    def forward(self, x):
        return self.proj(attend(self.qkv(x), self.heads))
