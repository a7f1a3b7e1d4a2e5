"""The instructor's ZeRO-1 and ZeRO-3 of 10_zero_and_fsdp, tuned (grader side: they are solutions).

Same contracts and the same shard rule (chunk_bounds, torch.tensor_split's) as the exercises'
`ShardedOptimizer` and `MiniFSDP`, so the hidden checks accept them (tests/grader/test_tuned_zero.py),
with the copies a straightforward version makes taken out:
  * the shard the optimizer steps is a view into a persistent send buffer of ⌈S/N⌉ elements, so the
    step writes straight into what the all-gather sends (no padding copy);
  * one `all_gather_single` into a persistent receive buffer (N·⌈S/N⌉), then one fused
    `torch._foreach_copy_` of every (piece, parameter) overlap into the weights: no torch.cat of
    the whole gradient or of the gathered pieces;
  * a step's gradient shard is copied from the parameters' .grad only where they overlap the shard;
  * when N divides S there is no padding, and the weights become views of the gathered buffer
    (as ZeroRedundancyOptimizer's parameters_as_bucket_view): the step and the gather write the
    weights in place, with no copy at all.
MiniFSDP's reduce-scatter copies the unit's gradient into a padded buffer once and calls
`reduce_scatter_single`; its all-gather fills the unit's buffer with one fused copy.
Collectives: on NCCL, `all_gather_single` and `reduce_scatter_single` (ring algorithms). On gloo,
whose all_gather and reduce_scatter are several times slower than the same bytes moved otherwise
(measured here, 2 ranks, 33.6 MB: all_gather_single 200 ms, reduce_scatter_single 133 ms; N async
broadcasts of the shards 14 ms, N async reduces 50 ms), the all-gather is N broadcasts (each rank's
shard from its owner) and the reduce-scatter N reduces (each chunk to its owner): the same bytes per
rank, (N-1)/N·S each.
Used by tests/bench/bench_zero.py against torch's ZeroRedundancyOptimizer and fully_shard.
"""

import torch
import torch.distributed as dist
from torch import nn

from dpcourse.reference.splits import chunk_bounds
from dpcourse.topics.zero.units import FlatUnit

PIECE = 2 ** 20  # elements per tensor the tuned ZeRO-1 optimizer steps


def _owner(group, j):
    return j if group is None else dist.get_global_rank(group, j)


def gather_padded(recv, send, chunk, group=None):
    """recv (N·chunk) <- every rank's send (chunk), in rank order."""
    if dist.get_backend(group) != "gloo":
        dist.all_gather_single(recv, send, group=group)
        return
    rank = dist.get_rank(group)
    recv[rank * chunk:(rank + 1) * chunk].copy_(send)
    works = [dist.broadcast(recv[j * chunk:(j + 1) * chunk], src=_owner(group, j), group=group, async_op=True)
             for j in range(dist.get_world_size(group))]
    for work in works:
        work.wait()


def reduce_scatter_padded(out, padded, chunk, group=None):
    """out (chunk) <- the sum over ranks of this rank's chunk of `padded` (N·chunk; clobbered)."""
    if dist.get_backend(group) != "gloo":
        dist.reduce_scatter_single(out, padded, group=group)
        return
    rank = dist.get_rank(group)
    works = [dist.reduce(padded[j * chunk:(j + 1) * chunk], dst=_owner(group, j), group=group, async_op=True)
             for j in range(dist.get_world_size(group))]
    for work in works:
        work.wait()
    out.copy_(padded[rank * chunk:(rank + 1) * chunk])


def overlaps(sizes, bounds, chunk):
    """[(index of the tensor, start in it, stop in it, start in the padded gathered vector)] for every
    piece where a flat vector made of tensors of `sizes` meets the ranks' `bounds`."""
    pieces, offset = [], 0
    for i, size in enumerate(sizes):
        for rank, (a, b) in enumerate(bounds):
            lo, hi = max(a, offset), min(b, offset + size)
            if lo < hi:
                pieces.append((i, lo - offset, hi - offset, rank * chunk + lo - a))
        offset += size
    return pieces


class TunedShardedOptimizer:
    """ZeRO-1 (see the module docstring): ShardedOptimizer's contract, fewer copies."""

    def __init__(self, params, optimizer_cls, **kwargs):
        self.params = [p for p in params if p.requires_grad]
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        sizes = [p.numel() for p in self.params]
        self.numel = sum(sizes)
        self.bounds = chunk_bounds(self.numel, self.world)
        self.chunk = -(-self.numel // self.world)
        a, b = self.bounds[self.rank]
        first = self.params[0]
        self.send = first.new_zeros(self.chunk)
        self.recv = first.new_empty(self.world * self.chunk)
        self.pieces = overlaps(sizes, self.bounds, self.chunk)
        self.mine = [(i, lo, hi, at - self.rank * self.chunk) for i, lo, hi, at in self.pieces
                     if self.rank * self.chunk <= at < (self.rank + 1) * self.chunk]
        with torch.no_grad():
            for i, lo, hi, at in self.mine:
                self.send[at:at + hi - lo].copy_(self.params[i].detach().view(-1)[lo:hi])
        self.in_place = self.numel % self.world == 0 and all(p.is_contiguous() for p in self.params)
        if self.in_place:  # no padding: the weights can live in the gathered buffer itself
            self.recv.copy_(torch.cat([p.detach().reshape(-1) for p in self.params]))
            offset = 0
            for p in self.params:
                p.data = self.recv[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
            self.send = self.recv[self.rank * self.chunk:(self.rank + 1) * self.chunk]
        self.shard = self.send[:b - a]
        self.grad = first.new_empty(b - a)
        # the optimizer steps the shard in pieces of 1 Mi elements: an elementwise optimizer does the
        # same arithmetic, and its several passes over a piece stay in cache (AdamW on 4.2 M float32
        # here: 52 ms as one tensor, 43 ms as 4 pieces)
        self.pieces_of_shard = [t.requires_grad_(True) for t in self.shard.split(PIECE)]
        self.pieces_of_grad = list(self.grad.split(PIECE))
        self.optimizer = optimizer_cls(self.pieces_of_shard, **kwargs)
        self._targets = [self.params[i].detach().view(-1)[lo:hi] for i, lo, hi, _ in self.pieces]
        self._sources = [self.recv[at:at + hi - lo] for i, lo, hi, at in self.pieces]

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def step(self, gradient_shard=None):
        if gradient_shard is None:
            for i, lo, hi, at in self.mine:
                self.grad[at:at + hi - lo].copy_(self.params[i].grad.view(-1)[lo:hi])
            grads = self.pieces_of_grad
        else:
            grads = gradient_shard.split(PIECE)
        for piece, grad in zip(self.pieces_of_shard, grads, strict=True):
            piece.grad = grad
        self.optimizer.step()
        gather_padded(self.recv, self.send, self.chunk)
        if not self.in_place:
            with torch.no_grad():
                torch._foreach_copy_(self._targets, self._sources)


class TunedMiniFSDP(nn.Module):
    """ZeRO-3 (see the module docstring): MiniFSDP's contract, fewer copies and allocations."""

    def __init__(self, module, group=None):
        super().__init__()
        self.module, self.group = module, group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.units, self.shards, self._sends = [], nn.ParameterList(), []
        for name, child in module.named_children():
            if not any(p.requires_grad for p in child.parameters()):
                continue
            unit = FlatUnit(child, name)
            bounds = chunk_bounds(unit.numel, self.world)
            chunk = -(-unit.numel // self.world)
            a, b = bounds[self.rank]
            send = unit.buffer.new_zeros(chunk)
            send[:b - a] = unit.buffer[a:b]
            shard = nn.Parameter(send[:b - a])  # shares send's memory: the step writes what is sent
            unit.free()
            unit.bounds, unit.chunk = bounds, chunk
            self.units.append(unit)
            self.shards.append(shard)
            self._sends.append(send)
            child.register_forward_pre_hook(lambda m, args, u=unit, s=send: self._gather(u, s))
            child.register_forward_hook(lambda m, args, out, u=unit, s=send: self._after_forward(u, s, out))
            unit.full.register_post_accumulate_grad_hook(
                lambda full, u=unit, s=shard: self._after_backward(u, s))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _gather(self, unit, send):
        if unit.unsharded:
            return
        buffer = unit.alloc()
        recv = buffer.new_empty(self.world * unit.chunk)
        gather_padded(recv, send, unit.chunk, self.group)
        sizes = [b - a for a, b in unit.bounds]
        pieces = [recv[j * unit.chunk:j * unit.chunk + size] for j, size in enumerate(sizes)]
        torch._foreach_copy_(list(buffer.split(sizes)), pieces)

    def _after_forward(self, unit, send, output):
        unit.free()
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: self._gather(unit, send))

    def _after_backward(self, unit, shard):
        grad, unit.full.grad = unit.full.grad, None
        sizes = [b - a for a, b in unit.bounds]
        padded = grad.new_zeros(self.world * unit.chunk)
        targets = [padded[j * unit.chunk:j * unit.chunk + size] for j, size in enumerate(sizes)]
        torch._foreach_copy_(targets, list(grad.split(sizes)))
        out = grad.new_empty(unit.chunk)
        reduce_scatter_padded(out, padded, unit.chunk, self.group)
        mine = out[:sizes[self.rank]].div_(self.world)
        shard.grad = mine if shard.grad is None else shard.grad + mine
        unit.free()


# exercise key -> its tuned version here (autograder/exercises.json lists it; a test imports each)
TUNED = {
    "sharded_optimizer": "TunedShardedOptimizer",
    "mini_fsdp": "TunedMiniFSDP",
}
