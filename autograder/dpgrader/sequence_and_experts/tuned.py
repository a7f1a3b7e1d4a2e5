"""The reference implementations of 12_sequence_and_experts (grader side: they are the solutions).

Same contracts as the exercises (`gather_sequence`, `reduce_scatter_sequence`, `SequenceParallelMLP`,
`ring_attention`, `balanced_positions`, `ulysses_attention`, `route_tokens`, `ExpertParallelMoE` with
its `AllToAll`), written the way the notebook asks: g and ḡ through `all_gather_single` and
`reduce_scatter_single`; the ring posts each step's send and receive together (batch_isend_irecv)
before computing with the block it holds, so the transfer overlaps the block's attention, and
trims every causal block to the queries and keys that meet; Ulysses stacks q, k, v into one
all-to-all; expert parallelism exchanges counts, then moves only the kept token-choices.
Used by tests/bench/bench_sequence_and_experts.py (the ring against one process's attention, the
expert-parallel layer against a dense layer of the same FLOPs) and by the tests of the hidden checks
(a correct implementation passes them).
"""

import copy
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def gather_sequence(x, group=None):
    """All ranks' pieces of the sequence (dim 0), in group-rank order; backward, reduce-scatter."""
    return GatherSequence.apply(x, group)


class GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n = dist.get_world_size(group)
        out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        n = dist.get_world_size(ctx.group)
        out = torch.empty((grad.shape[0] // n, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_single(out, grad.contiguous(), group=ctx.group)
        return out, None


def reduce_scatter_sequence(x, group=None):
    """This rank's piece (dim 0) of the sum of x over the group; backward, all-gather."""
    return ReduceScatterSequence.apply(x, group)


class ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n = dist.get_world_size(group)
        if x.shape[0] % n:
            raise ValueError(f"a sequence of {x.shape[0]} cannot be split evenly over {n} ranks")
        out = torch.empty((x.shape[0] // n, *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.reduce_scatter_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        n = dist.get_world_size(ctx.group)
        out = torch.empty((n * grad.shape[0], *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        dist.all_gather_single(out, grad.contiguous(), group=ctx.group)
        return out, None


class SequenceParallelMLP(nn.Module):
    """x + fc2(GELU(fc1(LayerNorm(x)))) with the sequence split in the LayerNorm and residual regions
    and the two linears tensor-parallel."""

    def __init__(self, block, group=None):
        super().__init__()
        self.group = group
        n, r = dist.get_world_size(group), dist.get_rank(group)
        hidden = block.fc1.out_features
        if hidden % n:
            raise ValueError(f"d_hidden = {hidden} cannot be split evenly over {n} ranks")
        rows = slice(r * hidden // n, (r + 1) * hidden // n)
        self.norm = copy.deepcopy(block.norm)
        self.fc1 = nn.Linear(block.fc1.in_features, hidden // n, bias=block.fc1.bias is not None)
        self.fc2 = nn.Linear(hidden // n, block.fc2.out_features, bias=block.fc2.bias is not None)
        self.fc1.to(block.fc1.weight)
        self.fc2.to(block.fc2.weight)
        with torch.no_grad():  # copies of the slices, not views
            self.fc1.weight.copy_(block.fc1.weight[rows])
            if block.fc1.bias is not None:
                self.fc1.bias.copy_(block.fc1.bias[rows])
            self.fc2.weight.copy_(block.fc2.weight[:, rows])
            if block.fc2.bias is not None:
                self.fc2.bias.copy_(block.fc2.bias)

    def forward(self, x):
        h = gather_sequence(self.norm(x), self.group)            # (s, b, d): every rank the whole sequence
        partial = F.linear(F.gelu(self.fc1(h)), self.fc2.weight)  # (s, b, d): this rank's share of the sum
        y = reduce_scatter_sequence(partial, self.group)          # (s/t, b, d): the sum, this rank's piece
        if self.fc2.bias is not None:
            y = y + self.fc2.bias
        return x + y


def attention_block(q, k, v, q_positions, k_positions, causal):
    """(out, lse) of q's rows against one block of keys and values: out = softmax(scores) v and
    lse = logsumexp(scores) over the keys each query may see (the notebook gives it to the learner)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(k_positions.view(1, -1) > q_positions.view(-1, 1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def ring_attention(q, k, v, positions, causal=False):
    """Attention of this rank's queries over the whole sequence; K/V blocks go around the ring."""
    n, me = dist.get_world_size(), dist.get_rank()
    mine = positions[me]
    out = torch.zeros_like(q)  # the merged output so far
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    kv = torch.stack((k, v))
    for step in range(n):
        source = (me - step) % n
        if step < n - 1:                       # pass the block on while computing with it
            incoming = torch.empty((2, *k.shape[:-2], len(positions[(source - 1) % n]), k.shape[-1]),
                                   dtype=k.dtype, device=k.device)
            requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (me + 1) % n),
                                               dist.P2POp(dist.irecv, incoming, (me - 1) % n)])
        keys = positions[source]
        rows, cols = torch.arange(len(mine)), torch.arange(len(keys))
        if causal:                             # only queries that see a key, only keys some query sees
            rows, cols = rows[mine >= keys.min()], cols[keys <= mine.max()]
        if len(rows) and len(cols):
            block_out, block_lse = attention_block(q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :],
                                                   mine[rows], keys[cols], causal)
            old = lse[..., rows]
            new = torch.logaddexp(old, block_lse)
            out[..., rows, :] = (out[..., rows, :] * torch.exp(old - new).unsqueeze(-1)
                                 + block_out * torch.exp(block_lse - new).unsqueeze(-1))
            lse[..., rows] = new
        if step < n - 1:
            for request in requests:
                request.wait()
            kv = incoming
    return out


def balanced_positions(seq_len, world_size):
    """Rank r's positions in the load-balanced split: pieces r and 2N - 1 - r of 2N, ascending."""
    pieces = torch.arange(seq_len).tensor_split(2 * world_size)
    return [torch.cat((pieces[r], pieces[2 * world_size - 1 - r])) for r in range(world_size)]


def ulysses_attention(q, k, v, positions, causal=False):
    """Attention by heads: all-to-all sequence -> heads, local attention, all-to-all back."""
    n = dist.get_world_size()
    b, heads, s, d = q.shape
    if heads % n:
        raise ValueError(f"{heads} heads cannot be split evenly over {n} ranks")
    h = heads // n
    sizes = [len(p) for p in positions]
    # piece j of what this rank sends: the q, k, v of rank j's heads, for this rank's positions
    qkv = torch.stack((q, k, v)).reshape(3, b, n, h, s, d).transpose(0, 2).contiguous()  # (n, b, 3, h, s, d)
    received = torch.empty(sum(b * 3 * h * size * d for size in sizes), dtype=q.dtype, device=q.device)
    dist.all_to_all_single(received, qkv.reshape(-1), [b * 3 * h * size * d for size in sizes],
                           [b * 3 * h * s * d] * n)
    pieces = received.split([b * 3 * h * size * d for size in sizes])
    # (b, 3, h, S, d): the pieces side by side along the sequence, rank 0's positions first
    whole = torch.cat([p.view(b, 3, h, size, d) for p, size in zip(pieces, sizes, strict=True)], dim=3)
    order = torch.cat(positions)
    out, _ = attention_block(whole[:, 0], whole[:, 1], whole[:, 2], order, order, causal)  # (b, h, S, d)
    back = torch.cat([piece.reshape(-1) for piece in out.split(sizes, dim=2)])
    mine = torch.empty(n * b * h * s * d, dtype=q.dtype, device=q.device)
    dist.all_to_all_single(mine, back, [b * h * s * d] * n, [b * h * size * d for size in sizes])
    return mine.view(n, b, h, s, d).transpose(0, 1).reshape(b, heads, s, d)


def route_tokens(logits, k, capacity_factor, alpha=0.01):
    """Top-k routing with a capacity per expert, and Switch Transformer's load-balancing loss."""
    tokens, n_experts = logits.shape
    probs = torch.softmax(logits, dim=-1)
    gates, experts = probs.topk(k, dim=-1)
    if k > 1:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    capacity = math.ceil(capacity_factor * k * tokens / n_experts)
    choices = experts.t().reshape(-1)                 # every token's first choice, then every second one
    one_hot = F.one_hot(choices, n_experts)
    place = (one_hot.cumsum(dim=0) * one_hot).sum(dim=-1) - 1   # its place in its expert's queue
    kept = (place < capacity).view(k, tokens).t()
    fraction = F.one_hot(experts[:, 0], n_experts).to(probs.dtype).mean(dim=0)
    aux_loss = alpha * n_experts * (fraction * probs.mean(dim=0)).sum()
    return experts, gates, kept, aux_loss


class ExpertParallelMoE(nn.Module):
    """A mixture-of-experts layer whose experts are spread over the ranks of a group."""

    def __init__(self, moe, group=None):
        super().__init__()
        n, r = dist.get_world_size(group), dist.get_rank(group)
        n_experts = len(moe.experts)
        if n_experts % n:
            raise ValueError(f"{n_experts} experts cannot be split evenly over {n} ranks")
        self.group, self.k, self.capacity_factor = group, moe.k, moe.capacity_factor
        self.n_experts, self.per_rank = n_experts, n_experts // n
        self.router = copy.deepcopy(moe.router)
        self.experts = nn.ModuleList(copy.deepcopy(moe.experts[e])
                                     for e in range(r * self.per_rank, (r + 1) * self.per_rank))
        self.dropped = 0

    def forward(self, x):
        n = dist.get_world_size(self.group)
        experts, gates, kept, aux_loss = route_tokens(self.router(x), self.k, self.capacity_factor)
        self.dropped = int((~kept).sum())
        token = torch.arange(x.shape[0], device=x.device).unsqueeze(1).expand_as(experts)[kept]
        expert, gate = experts[kept], gates[kept]
        order = torch.argsort(expert, stable=True)       # grouped by expert, so by destination rank
        token, expert, gate = token[order], expert[order], gate[order]
        counts = torch.bincount(expert, minlength=self.n_experts)
        incoming = torch.empty_like(counts)
        dist.all_to_all_single(incoming, counts, group=self.group)   # [rank j's count for my expert e]
        incoming = incoming.view(n, self.per_rank)
        send = counts.view(n, self.per_rank).sum(dim=1).tolist()
        recv = incoming.sum(dim=1).tolist()
        arrived = AllToAll.apply(x[token], send, recv, self.group)
        local = torch.arange(self.per_rank, device=x.device).repeat(n).repeat_interleave(incoming.reshape(-1))
        done = torch.zeros_like(arrived)
        for e, module in enumerate(self.experts):
            rows = (local == e).nonzero().flatten()
            done = done.index_copy(0, rows, module(arrived[rows]))
        back = AllToAll.apply(done, recv, send, self.group)
        y = torch.zeros_like(x).index_add(0, token, back * gate.unsqueeze(1))
        return y, aux_loss


class AllToAll(torch.autograd.Function):
    """Rows of x to the ranks of the group (send_splits[j] rows to rank j); backward, the way back."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        out = grad.new_empty((sum(send_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), send_splits, recv_splits, group=ctx.group)
        return out, None, None, None


# exercise key -> its tuned version here (autograder/exercises.json lists it; a test imports each)
TUNED = {
    "gather_sequence": "gather_sequence",
    "reduce_scatter_sequence": "reduce_scatter_sequence",
    "sequence_parallel_mlp": "SequenceParallelMLP",
    "ring_attention": "ring_attention",
    "balanced_positions": "balanced_positions",
    "ulysses_attention": "ulysses_attention",
    "route_tokens": "route_tokens",
    "expert_parallel_moe": "ExpertParallelMoE",
}
