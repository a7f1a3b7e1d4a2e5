"""Planted bugs for 12_sequence_and_experts: each must lose the listed cells with a message saying why.

Realistic mistakes, at least four per exercise: g's backward all-reducing, keeping its own gradient,
averaging, or gathering over the world; ḡ without the reduce, through an all-reduce, without its
check of the length, gathering the gradient in the wrong order; the sequence-parallel block with
its LayerNorm after the gather (right values, t times the memory), fc2's bias before the sum, the
residual forgotten, weights that are views of the block's, slices taken by world rank; ring attention
merged without the log-sum-exp shift, K/V passed the wrong way, the causal mask on block-local
indices, K and V sent separately, every received block kept, the transfer posted after the compute,
hidden blocks computed (nan), no causal skipping; the balanced split contiguous, off by one, not ascending, losing the remainder; Ulysses with transposed
splits or none at all, no check of the heads, its pieces in the wrong order or viewed (3, b, ...), no mask;
routing with the capacity applied before the top-k, the auxiliary loss with the wrong fraction or
without E or detached from P (the layer built on it keeps its marks), top-2 gates not renormalised,
choices served token by token, the capacity rounded down;
expert parallelism with its all-to-all splits transposed, no gradient through the dispatch, its
aux_loss returned detached, gates forgotten, dropped tokens sent anyway, experts picked by world rank, experts that received no
token skipped or results written only where rows arrived (a rank that receives nothing then skips
the backward all-to-all). A bug lists the cell that shows it (the basic one when both would say the same, so
that grading the chapter stays as fast as its neighbours'), and the cells it must keep passing.
"""

from dpgrader.planted import Bug, solution_code

ASSIGNMENT = "12_sequence_and_experts"
ROUTE = ["test_route_tokens_basic", "test_route_tokens_top2"]

# the block calls the learner's two operators, the layer the learner's router: their bugs are planted next to
# those solutions
SOLVED_OPERATORS = {"gather_sequence": solution_code(ASSIGNMENT, "gather_sequence"),
                    "reduce_scatter_sequence": solution_code(ASSIGNMENT, "reduce_scatter_sequence")}
SOLVED_ROUTER = {"route_tokens": solution_code(ASSIGNMENT, "route_tokens")}
SOLVED_MOE = {"expert_parallel_moe": solution_code(ASSIGNMENT, "expert_parallel_moe")}


def _all(cells, fragment):
    return {cell: fragment for cell in cells}


def _block_bug(name, patch, loses, keeps=()):
    return Bug("sequence_parallel_mlp", name, patch=patch, cells=dict(SOLVED_OPERATORS), loses=loses,
               keeps=list(keeps))


def _moe_bug(name, patch, loses, keeps=()):
    return Bug("expert_parallel_moe", name, patch=patch, cells=dict(SOLVED_ROUTER), loses=loses, keeps=list(keeps))


BUGS = [
    # -- gather_sequence ---------------------------------------------------------------------------------
    Bug("gather_sequence", "g_backward_all_reduces",
        patch=[("        dist.reduce_scatter_single(out, grad.contiguous(), group=ctx.group)\n",
                "        total = grad.clone()\n"
                "        dist.all_reduce(total, group=ctx.group)\n"
                "        out = total.chunk(n)[dist.get_rank(ctx.group)].contiguous()\n")],
        loses={"test_gather_sequence_basic": "expected reduce_scatter or reduce_scatter_tensor"}),
    Bug("gather_sequence", "g_keeps_its_own_gradient",
        patch=[("        dist.reduce_scatter_single(out, grad.contiguous(), group=ctx.group)\n        "
                "return out, None",
                "        return grad.chunk(n)[dist.get_rank(ctx.group)].contiguous(), None")],
        loses={"test_gather_sequence_basic": "issued no communication in backward"}),
    Bug("gather_sequence", "g_backward_averages",
        patch=[("        return out, None\n", "        return out / n, None\n")],
        loses={"test_gather_sequence_basic": "averaged: backward sums the ranks' gradients"}),
    Bug("gather_sequence", "g_over_the_world",
        patch=[("        n = dist.get_world_size(group)\n", "        n = dist.get_world_size()\n"),
               ("        dist.all_gather_single(out, x.contiguous(), group=group)\n",
                "        dist.all_gather_single(out, x.contiguous())\n")],
        loses={"test_gather_sequence_groups": "pass the group on to every collective"},
        keeps=["test_gather_sequence_basic"]),

    # -- reduce_scatter_sequence -----------------------------------------------------------------------------
    Bug("reduce_scatter_sequence", "reduce_missing",
        patch=[("        dist.reduce_scatter_single(out, x.contiguous(), group=group)\n",
                "        out = x.chunk(n)[dist.get_rank(group)].clone()\n")],
        loses={"test_reduce_scatter_sequence_basic": "issued no communication in forward"}),
    Bug("reduce_scatter_sequence", "all_reduce_then_piece",
        patch=[("        dist.reduce_scatter_single(out, x.contiguous(), group=group)\n",
                "        total = x.clone()\n"
                "        dist.all_reduce(total, group=group)\n"
                "        out = total.chunk(n)[dist.get_rank(group)].clone()\n")],
        loses={"test_reduce_scatter_sequence_basic": "expected reduce_scatter or reduce_scatter_tensor"}),
    Bug("reduce_scatter_sequence", "no_check_of_the_length",
        patch=[("        if x.shape[0] % n:\n", "        if False:\n")],
        loses={"test_reduce_scatter_sequence_groups": "expected a ValueError"},
        keeps=["test_reduce_scatter_sequence_basic"]),
    Bug("reduce_scatter_sequence", "gradient_pieces_reversed",
        patch=[("        return out, None", "        return torch.cat(out.chunk(n)[::-1]), None")],
        loses={"test_reduce_scatter_sequence_basic": "gathered pieces are in the wrong order"}),

    # -- SequenceParallelMLP (next to the solved operators) ---------------------------------------------------
    _block_bug("layer_norm_after_the_gather",
               patch=[("        h = gather_sequence(self.norm(x), self.group)",
                       "        h = self.norm(gather_sequence(x, self.group))")],
               loses={"test_sequence_parallel_mlp_basic": "the LayerNorm ran on the whole gathered sequence"}),
    _block_bug("fc2_bias_before_the_sum",
               patch=[("        partial = F.linear(F.gelu(self.fc1(h)), self.fc2.weight)",
                       "        partial = self.fc2(F.gelu(self.fc1(h)))"),
                      ("        if self.fc2.bias is not None:\n            y = y + self.fc2.bias\n", "")],
               loses={"test_sequence_parallel_mlp_basic": "added on every rank before the reduce-scatter"}),
    _block_bug("residual_forgotten",
               patch=[("        return x + y\n", "        return y\n")],
               loses={"test_sequence_parallel_mlp_basic": "the residual x is missing"}),
    _block_bug("weights_are_views_of_the_block",  # the text: copy the values (copy_), not views of the block's
               patch=[("            self.fc1.weight.copy_(block.fc1.weight[rows])\n",
                       "            self.fc1.weight = nn.Parameter(block.fc1.weight[rows])\n"),
                      ("            self.fc2.weight.copy_(block.fc2.weight[:, rows])\n",
                       "            self.fc2.weight = nn.Parameter(block.fc2.weight[:, rows])\n")],
               loses={"test_sequence_parallel_mlp_basic": "fc1.weight is a view of the unsharded module's"}),
    _block_bug("slices_by_world_rank",
               patch=[("        n, r = dist.get_world_size(group), dist.get_rank(group)\n",
                       "        n, r = dist.get_world_size(group), dist.get_rank()\n")],
               loses={"test_sequence_parallel_mlp_groups": "raised on rank 2"},
               keeps=["test_sequence_parallel_mlp_basic"]),

    # -- ring_attention -----------------------------------------------------------------------------------
    Bug("ring_attention", "merged_without_the_max_shift",
        patch=[("            new = torch.logaddexp(old, block_lse)\n"
                "            out[..., rows, :] = (out[..., rows, :] * torch.exp(old - new).unsqueeze(-1)\n"
                "                                 + block_out * torch.exp(block_lse - new).unsqueeze(-1))\n"
                "            lse[..., rows] = new\n",
                "            total = torch.exp(old) + torch.exp(block_lse)\n"
                "            out[..., rows, :] = (out[..., rows, :] * torch.exp(old).unsqueeze(-1)\n"
                "                                 + block_out * torch.exp(block_lse).unsqueeze(-1)) / "
                "total.unsqueeze(-1)\n"
                "            lse[..., rows] = torch.log(total)\n")],
        loses={"test_ring_attention_causal": "holds inf or nan"}),
    Bug("ring_attention", "kv_passed_the_wrong_way",
        patch=[("dist.P2POp(dist.isend, kv, (me + 1) % n)", "dist.P2POp(dist.isend, kv, (me - 1) % n)"),
               ("dist.P2POp(dist.irecv, incoming, (me - 1) % n)", "dist.P2POp(dist.irecv, incoming, (me + 1) % n)")],
        loses={"test_ring_attention_work": "pass blocks to the next rank"}),
    Bug("ring_attention", "causal_mask_on_block_local_indices",
        patch=[("                                                   mine[rows], keys[cols], causal)",
                "                                                   rows, cols, causal)")],
        loses={"test_ring_attention_causal": "positions within the blocks"}),
    Bug("ring_attention", "k_and_v_sent_separately",
        patch=[("            requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (me + 1) % n),\n"
                "                                               dist.P2POp(dist.irecv, incoming, (me - 1) % "
                "n)])\n",
                "            requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv[0].contiguous(), "
                "(me + 1) % n),\n"
                "                                               dist.P2POp(dist.isend, kv[1].contiguous(), "
                "(me + 1) % n),\n"
                "                                               dist.P2POp(dist.irecv, incoming[0], (me - "
                "1) % n),\n"
                "                                               dist.P2POp(dist.irecv, incoming[1], (me - "
                "1) % n)])\n")],
        loses={"test_ring_attention_basic": "one message per step with K and V together"}),
    Bug("ring_attention", "keeps_every_block_it_received",
        patch=[("    kv = torch.stack((k, v))\n", "    kv = torch.stack((k, v))\n    received = []\n"),
               ("            kv = incoming\n", "            kv = incoming\n            received.append(incoming)\n")],
        loses={"test_ring_attention_work": "it keeps the blocks it received"}),
    Bug("ring_attention", "transfer_posted_after_the_compute",  # the text: post, compute, then wait
        patch=[("        if step < n - 1:                       # pass the block on while computing with it\n"
                "            incoming = torch.empty((2, *k.shape[:-2], len(positions[(source - 1) % n]), "
                "k.shape[-1]),\n"
                "                                   dtype=k.dtype, device=k.device)\n"
                "            requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (me + 1) % n),\n"
                "                                               dist.P2POp(dist.irecv, incoming, (me - 1) % "
                "n)])\n", ""),
               ("        if step < n - 1:\n            for request in requests:\n",
                "        if step < n - 1:\n"
                "            incoming = torch.empty((2, *k.shape[:-2], len(positions[(source - 1) % n]), "
                "k.shape[-1]),\n"
                "                                   dtype=k.dtype, device=k.device)\n"
                "            requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (me + 1) % n),\n"
                "                                               dist.P2POp(dist.irecv, incoming, (me - 1) % "
                "n)])\n"
                "            for request in requests:\n")],
        loses={"test_ring_attention_basic": "before posting the send and the receive of step 0"}),
    Bug("ring_attention", "hidden_blocks_computed",  # every block for every query: rows that see no key are nan
        patch=[("        if causal:                             # only queries that see a key, only keys "
                "some query sees\n"
                "            rows, cols = rows[mine >= keys.min()], cols[keys <= mine.max()]\n", "")],
        loses={"test_ring_attention_causal": "a block the causal mask hides entirely"}),
    Bug("ring_attention", "no_causal_skipping",
        patch=[("        if causal:                             # only queries that see a key, only keys "
                "some query sees\n"
                "            rows, cols = rows[mine >= keys.min()], cols[keys <= mine.max()]\n", ""),
               ("            out[..., rows, :] = (out[..., rows, :] * torch.exp(old - new).unsqueeze(-1)\n"
                "                                 + block_out * torch.exp(block_lse - new).unsqueeze(-1))\n",
                "            out[..., rows, :] = (out[..., rows, :] * torch.exp(old - new).unsqueeze(-1)\n"
                "                                 + block_out.nan_to_num(0.0) * torch.exp(block_lse - "
                "new).unsqueeze(-1))\n")],
        loses={"test_ring_attention_work": "its causal pairs need"}),

    # -- balanced_positions ------------------------------------------------------------------------------
    Bug("balanced_positions", "contiguous_split",
        patch=[("    return [torch.cat((pieces[r], pieces[2 * world_size - 1 - r])) for r in "
                "range(world_size)]",
                "    return list(torch.arange(seq_len).tensor_split(world_size))")],
        loses={"test_balanced_positions_basic": "the contiguous split"}),
    Bug("balanced_positions", "tail_piece_off_by_one",
        patch=[("pieces[2 * world_size - 1 - r]", "pieces[2 * world_size - 2 - r]")],
        loses={"test_balanced_positions_basic": "expected pieces 0 and 7 of 8"}),
    Bug("balanced_positions", "tail_before_head",
        patch=[("torch.cat((pieces[r], pieces[2 * world_size - 1 - r]))",
                "torch.cat((pieces[2 * world_size - 1 - r], pieces[r]))")],
        loses={"test_balanced_positions_basic": "not ascending"}),
    Bug("balanced_positions", "remainder_lost",
        patch=[("    pieces = torch.arange(seq_len).tensor_split(2 * world_size)\n",
                "    size = seq_len // (2 * world_size)\n"
                "    pieces = [torch.arange(i * size, (i + 1) * size) for i in range(2 * world_size)]\n")],
        loses={"test_balanced_positions_uneven": "balanced_positions(10, 3): rank 0 holds"},
        keeps=["test_balanced_positions_basic"]),

    # -- ulysses_attention ------------------------------------------------------------------------------
    Bug("ulysses_attention", "output_splits_transposed",
        patch=[("    dist.all_to_all_single(mine, back, [b * h * s * d] * n, [b * h * size * d for size in "
                "sizes])",
                "    dist.all_to_all_single(mine, back, [b * h * size * d for size in sizes], [b * h * s * "
                "d] * n)")],
        loses={"test_ulysses_attention_uneven": "raised on rank"}),
    Bug("ulysses_attention", "split_sizes_left_out",  # even pieces work; uneven ones: gloo's raw enforce failure
        patch=[("    dist.all_to_all_single(received, qkv.reshape(-1), [b * 3 * h * size * d for size in sizes],\n"
                "                           [b * 3 * h * s * d] * n)\n",
                "    dist.all_to_all_single(received, qkv.reshape(-1))\n")],
        loses={"test_ulysses_attention_uneven": "without split sizes sends and receives 4 equal pieces"},
        keeps=["test_ulysses_attention_basic"]),
    Bug("ulysses_attention", "heads_not_checked",
        patch=[("    if heads % n:\n", "    if False:\n")],
        loses={"test_ulysses_attention_uneven": "expected a ValueError"},
        keeps=["test_ulysses_attention_basic"]),
    Bug("ulysses_attention", "pieces_in_reverse_order",
        patch=[("    whole = torch.cat([p.view(b, 3, h, size, d) for p, size in zip(pieces, sizes, "
                "strict=True)], dim=3)",
                "    whole = torch.cat([p.view(b, 3, h, size, d) for p, size in zip(pieces, sizes, "
                "strict=True)][::-1], dim=3)")],
        loses={"test_ulysses_attention_basic": "'s output (its queries"}),
    Bug("ulysses_attention", "pieces_viewed_three_by_batch",  # (3, b, ...) for (b, 3, ...): right at batch 1
        patch=[("    whole = torch.cat([p.view(b, 3, h, size, d) for p, size in zip(pieces, sizes, strict=True)], "
                "dim=3)",
                "    whole = torch.cat([p.view(3, b, h, size, d) for p, size in zip(pieces, sizes, strict=True)], "
                "dim=3)"),
               ("attention_block(whole[:, 0], whole[:, 1], whole[:, 2], order, order, causal)",
                "attention_block(whole[0], whole[1], whole[2], order, order, causal)")],
        loses={"test_ulysses_attention_basic": "is wrong: first wrong at batch 0, head 0, position 0"}),
    Bug("ulysses_attention", "causal_mask_dropped",
        patch=[("order, order, causal)", "order, order, False)")],
        loses={"test_ulysses_attention_uneven": "'s output (its queries"}),
    # -- route_tokens -----------------------------------------------------------------------------------
    Bug("route_tokens", "capacity_before_the_top_k",
        patch=[("    kept = (place < capacity).view(k, tokens).t()\n",
                "    kept = (torch.arange(tokens) < capacity).unsqueeze(1).expand(tokens, k).clone()\n")],
        loses=_all(ROUTE, "is dropped, expected kept")),
    Bug("route_tokens", "aux_fraction_of_kept_tokens",
        patch=[("    fraction = F.one_hot(experts[:, 0], n_experts).to(probs.dtype).mean(dim=0)",
                "    fraction = F.one_hot(experts[:, 0][kept[:, 0]], n_experts).to(probs.dtype).sum(dim=0) "
                "/ tokens")],
        loses={"test_route_tokens_top2": "counted the kept tokens only"}),
    Bug("route_tokens", "aux_without_the_number_of_experts",
        patch=[("    aux_loss = alpha * n_experts * (fraction * probs.mean(dim=0)).sum()",
                "    aux_loss = alpha * (fraction * probs.mean(dim=0)).sum()")],
        loses=_all(ROUTE, "the factor E (the number of experts) is missing")),
    Bug("route_tokens", "top2_gates_not_renormalised",
        patch=[("    if k > 1:\n        gates = gates / gates.sum(dim=-1, keepdim=True)\n", "")],
        loses={"test_route_tokens_top2": "divided by their sum"},
        keeps=["test_route_tokens_basic"]),
    Bug("route_tokens", "choices_served_token_by_token",
        patch=[("    choices = experts.t().reshape(-1)", "    choices = experts.reshape(-1)"),
               ("    kept = (place < capacity).view(k, tokens).t()", "    kept = (place < capacity).view(tokens, k)")],
        loses={"test_route_tokens_top2": "first choices in token order, then second choices"},
        keeps=["test_route_tokens_basic"]),
    Bug("route_tokens", "aux_loss_detached",  # the text: differentiable through P; the layer on it is right
        patch=[("    aux_loss = alpha * n_experts * (fraction * probs.mean(dim=0)).sum()",
                "    aux_loss = alpha * n_experts * (fraction * probs.detach().mean(dim=0)).sum()")],
        cells=dict(SOLVED_MOE), loses=_all(ROUTE, "aux_loss does not require grad when the logits do"),
        keeps=["test_expert_parallel_moe_basic", "test_expert_parallel_moe_top2"]),
    Bug("route_tokens", "capacity_rounded_down",
        patch=[("math.ceil(capacity_factor * k * tokens / n_experts)",
                "math.floor(capacity_factor * k * tokens / n_experts)")],
        loses={"test_route_tokens_basic": "ceil(1 x 1 x 6 / 4) = 2"}),

    # -- ExpertParallelMoE (next to the solved router) ----------------------------------------------------
    _moe_bug("all_to_all_splits_transposed",
             patch=[("        arrived = AllToAll.apply(x[token], send, recv, self.group)",
                     "        arrived = AllToAll.apply(x[token], recv, send, self.group)")],
             loses={"test_expert_parallel_moe_basic": "raised on rank"}),
    _moe_bug("no_gradient_through_the_dispatch",
             patch=[("        arrived = AllToAll.apply(x[token], send, recv, self.group)",
                     "        arrived = AllToAll.apply(x[token].detach(), send, recv, self.group)")],
             loses={"test_expert_parallel_moe_basic": "gradient of x"}),
    _moe_bug("gates_forgotten",
             patch=[("index_add(0, token, back * gate.unsqueeze(1))", "index_add(0, token, back)")],
             loses={"test_expert_parallel_moe_basic": "not weighed by their gates"}),
    _moe_bug("dropped_tokens_sent_anyway",
             patch=[("        self.dropped = int((~kept).sum())\n",
                     "        self.dropped = int((~kept).sum())\n        kept = torch.ones_like(kept)\n")],
             loses={"test_expert_parallel_moe_basic": "processed too"}),
    _moe_bug("experts_by_world_rank",
             patch=[("        n, r = dist.get_world_size(group), dist.get_rank(group)\n",
                     "        n, r = dist.get_world_size(group), dist.get_rank()\n")],
             loses={"test_expert_parallel_moe_top2": "whose world rank is"},
             keeps=["test_expert_parallel_moe_basic"]),
    _moe_bug("aux_loss_returned_detached",  # its router's aux_loss is differentiable: the layer is to blame
             patch=[("        return y, aux_loss\n", "        return y, aux_loss.detach()\n")],
             loses={"test_expert_parallel_moe_basic": "though your route_tokens' aux_loss is differentiable"}),
    _moe_bug("results_written_in_place_only_where_rows_arrived",  # a rank that receives nothing skips backward
             patch=[("            done = done.index_copy(0, rows, module(arrived[rows]))\n",
                     "            if len(rows):\n"
                     "                done[rows] = module(arrived[rows])\n")],
             loses={"test_expert_parallel_moe_top2": "Build the experts' results from the received rows"},
             keeps=["test_expert_parallel_moe_basic"]),
    _moe_bug("experts_without_tokens_skipped",
             patch=[("            rows = (local == e).nonzero().flatten()\n",
                     "            rows = (local == e).nonzero().flatten()\n"
                     "            if len(rows) == 0:\n"
                     "                continue\n")],
             loses={"test_expert_parallel_moe_top2": "Build the experts' results from the received rows"}),
]

