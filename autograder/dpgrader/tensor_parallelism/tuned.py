"""The reference tensor-parallel layers of 08_tensor_parallelism (grader side: they are the solutions).

Same contracts as the exercises (`copy_to_tp`, `reduce_from_tp`, `gather_from_tp`,
`ColumnParallelLinear`, `RowParallelLinear`, `TensorParallelMLP`, `TensorParallelAttention`),
written the way Megatron-LM's `tensor_parallel` package runs them:
  * f's all-reduce happens inside the column-parallel matmul's own backward, launched
    asynchronously on the input gradient and overlapped with the weight-gradient product
    (Megatron's `LinearWithGradAccumulationAndAsyncCommunication`); no extra copies;
  * g all-reduces the row-parallel partial product in place (it is a fresh tensor) and adds
    the bias once, after the sum.
Used by tests/bench/bench_tensor_parallel.py (against torch's `parallelize_module` on the same
model) and by the tests of the hidden checks (a correct implementation passes them).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dpcourse.topics.tensor.models import attend


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ReduceInPlace(torch.autograd.Function):
    """g on a tensor nobody else holds (a fresh partial product): all-reduced in place."""

    @staticmethod
    def forward(ctx, partial, group):
        dist.all_reduce(partial, group=group)
        ctx.mark_dirty(partial)
        return partial

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dimension forward; keep this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, x.contiguous(), group=group)
        return torch.cat(pieces, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        world, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(world, dim=-1)[rank].contiguous(), None


class _ScatterToTP(torch.autograd.Function):
    """Keep this rank's slice of the last dimension forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        return x.chunk(world, dim=-1)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        pieces = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(pieces, grad.contiguous(), group=ctx.group)
        return torch.cat(pieces, dim=-1), None


def copy_to_tp(x, group=None):
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x, group=None):
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x, group=None):
    return _GatherFromTP.apply(x, group)


def scatter_to_tp(x, group=None):
    return _ScatterToTP.apply(x, group)


class _ColumnLinear(torch.autograd.Function):
    """f, then x·Wᵀ + b, in one function: backward launches the all-reduce of the input gradient
    asynchronously and computes the weight gradient while it travels."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x, work = None, None
        if ctx.needs_input_grad[0]:  # the same on every rank of the group: all issue it, or none
            grad_x = grad @ weight
            work = dist.all_reduce(grad_x, group=ctx.group, async_op=True)
        grad_2d, x_2d = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_w = grad_2d.t() @ x_2d
        grad_b = grad_2d.sum(0) if ctx.has_bias else None
        if work is not None:
            work.wait()
        return grad_x, grad_w, grad_b, None


def _split(size, group, what):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if size % world:
        raise ValueError(f"{what} of size {size} cannot be split evenly over {world} ranks")
    step = size // world
    return slice(rank * step, (rank + 1) * step)


class ColumnParallelLinear(nn.Module):
    """Rank r holds rows r·out/N ... of the weight (and bias): output features split over the group."""

    def __init__(self, linear, group=None, gather_output=False):
        super().__init__()
        self.group, self.gather_output = group, gather_output
        rows = _split(linear.out_features, group, "out_features")
        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach()[rows].clone())

    def forward(self, x):
        y = _ColumnLinear.apply(x, self.weight, self.bias, self.group)
        return gather_from_tp(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Rank r holds columns r·in/N ... of the weight and the whole bias: partial products, summed by g."""

    def __init__(self, linear, group=None, input_is_parallel=True):
        super().__init__()
        self.group, self.input_is_parallel = group, input_is_parallel
        cols = _split(linear.in_features, group, "in_features")
        # a copy, contiguous: on one rank the slice is the whole weight, and .contiguous() would return it
        self.weight = nn.Parameter(
            linear.weight.detach()[:, cols].clone(memory_format=torch.contiguous_format))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        y = _ReduceInPlace.apply(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class TensorParallelMLP(nn.Module):
    """fc1 column-parallel, GELU on each rank's slice, fc2 row-parallel: one all-reduce each way."""

    def __init__(self, mlp, group=None):
        super().__init__()
        self.fc1 = ColumnParallelLinear(mlp.fc1, group)
        self.act = nn.GELU()
        self.fc2 = RowParallelLinear(mlp.fc2, group)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class TensorParallelAttention(nn.Module):
    """qkv column-parallel (whole heads per rank), attention on local heads, proj row-parallel."""

    def __init__(self, attention, group=None):
        super().__init__()
        world = dist.get_world_size(group)
        if attention.n_heads % world:
            raise ValueError(f"{attention.n_heads} heads cannot be split evenly over {world} ranks")
        self.heads = attention.n_heads // world
        self.qkv = ColumnParallelLinear(attention.qkv, group)
        self.proj = RowParallelLinear(attention.proj, group)

    def forward(self, x):
        return self.proj(attend(self.qkv(x), self.heads))


# exercise key -> its tuned version here (autograder/exercises.json lists it; a test imports each)
TUNED = {
    "copy_to_tp": "copy_to_tp",
    "reduce_from_tp": "reduce_from_tp",
    "gather_from_tp": "gather_from_tp",
    "column_parallel_linear": "ColumnParallelLinear",
    "row_parallel_linear": "RowParallelLinear",
    "tensor_parallel_mlp": "TensorParallelMLP",
    "tensor_parallel_attention": "TensorParallelAttention",
}
