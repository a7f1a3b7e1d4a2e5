"""Planted bugs for 10_zero_and_fsdp: each edits the solution one realistic way and must lose the listed
test cells with a message that names the mistake (tests/grader/planted.py).
"""

from dpgrader.planted import Bug, solution_code

ASSIGNMENT = "10_zero_and_fsdp"

GATHER = """        pieces = [self.shard.new_empty(chunk) for _ in range(self.world)]
        dist.all_gather(pieces, padded(self.shard.detach(), chunk))
        flat = torch.cat([piece[:b - a] for piece, (a, b) in zip(pieces, self.bounds, strict=True)])
"""

CEIL_BOUNDS = """def ceil_bounds(n, world):
    # torch.chunk's rule: ⌈n/N⌉ elements per rank, the last ranks short
    size = -(-n // world)
    return [(min(r * size, n), min((r + 1) * size, n)) for r in range(world)]


"""

BUGS = [
    # ------------------------------------------------------------------ 1. ShardedOptimizer (ZeRO-1)
    Bug("sharded_optimizer", "state_kept_for_all_parameters",
        patch=[("self.optimizer = optimizer_cls([self.shard], **kwargs)",
                "self.optimizer = optimizer_cls(self.params, **kwargs)")],
        loses={"test_sharded_optimizer_basic": "optimizer steps all 994 elements",
               "test_sharded_optimizer_uneven": "ZeRO-1 keeps optimizer state for this rank's shard only"}),
    Bug("sharded_optimizer", "shard_boundaries_last_rank_takes_the_rest",  # S // N each, the rest to the last
        patch=[("self.bounds = chunk_bounds(self.numel, self.world)",
                "size = self.numel // self.world\n"
                "        self.bounds = [(r * size, (r + 1) * size if r < self.world - 1 else self.numel)\n"
                "                       for r in range(self.world)]")],
        loses={"test_sharded_optimizer_uneven": "its shard (what its optimizer steps) has 331 elements, "
                                                 "expected 332"},
        keeps=["test_sharded_optimizer_basic"]),
    Bug("sharded_optimizer", "parameters_not_gathered_after_step",  # only this rank's shard is written back
        patch=[(GATHER, "        flat = torch.cat([q.detach().reshape(-1) for q in self.params])\n"
                        "        flat[start:stop] = self.shard.detach()\n")],
        loses={"test_sharded_optimizer_basic": "still hold their initial values",
               "test_sharded_optimizer_uneven": "must all-gather every rank's updated shard"}),
    Bug("sharded_optimizer", "all_reduce_instead_of_all_gather",  # right values, twice the bytes
        patch=[(GATHER, "        flat = self.shard.new_zeros(self.numel)\n"
                        "        flat[start:stop] = self.shard.detach()\n"
                        "        dist.all_reduce(flat)\n")],
        loses={"test_sharded_optimizer_basic": "2.00x an all-gather of the shards",
               "test_sharded_optimizer_uneven": "An all-reduce would send twice that"}),
    Bug("sharded_optimizer", "gradient_shard_ignored",  # always slices the .grads, which ZeRO-2 has freed
        patch=[("        if gradient_shard is None:\n            gradient_shard = torch.cat(",
                "        if True:\n            gradient_shard = torch.cat(")],
        loses={"test_sharded_optimizer_uneven": "it must step with that argument, not with the .grads"},
        keeps=["test_sharded_optimizer_basic"]),
    Bug("sharded_optimizer", "shards_joined_with_their_padding",  # 994 on 3 ranks: pieces 332, 331+1, 331+1
        patch=[("        flat = torch.cat([piece[:b - a] for piece, (a, b) in zip(pieces, self.bounds, strict=True)])\n",
                "        flat = torch.cat(pieces)[:self.numel]\n")],
        loses={"test_sharded_optimizer_uneven": "joined with their padding and cut at the end"},
        keeps=["test_sharded_optimizer_basic"]),
    Bug("sharded_optimizer", "shard_slice_not_cloned",  # a view keeps the whole flat copy alive
        patch=[("self.shard = flat[start:stop].clone().requires_grad_(True)",
                "self.shard = flat[start:stop].requires_grad_(True)")],
        loses={"test_sharded_optimizer_basic": "a view into a full-size tensor",
               "test_sharded_optimizer_uneven": "(.clone() the slice)"}),

    # ------------------------------------------------------------------ 2. reduce_scatter_gradients (ZeRO-2)
    Bug("reduce_scatter_gradients", "shard_summed_not_averaged",
        patch=[("return out[:stop - start] / world", "return out[:stop - start]")],
        loses={"test_reduce_scatter_gradients_basic": "2 times the average",
               "test_reduce_scatter_gradients_uneven": "a reduce-scatter sums over ranks; divide by N = 3"}),
    Bug("reduce_scatter_gradients", "all_reduce_then_slice",  # right shard, twice the bytes
        patch=[("    out = flat.new_empty(chunk)\n"
                "    dist.reduce_scatter(out, [padded(flat[a:b], chunk) for a, b in bounds])\n",
                "    dist.all_reduce(flat)\n"
                "    out = flat[bounds[rank][0]:]\n")],
        loses={"test_reduce_scatter_gradients_basic": "2.00x a reduce-scatter",
               "test_reduce_scatter_gradients_uneven": "An all-reduce sends 2(N-1)/N·S"}),
    Bug("reduce_scatter_gradients", "full_gradients_kept",
        patch=[("    for param in trainable:\n        param.grad = None  # keep only the shard\n", "")],
        loses={"test_reduce_scatter_gradients_basic": "still hold full gradients",
               "test_reduce_scatter_gradients_uneven": "set every p.grad to None"}),
    Bug("reduce_scatter_gradients", "torch_chunk_boundaries",  # ⌈S/N⌉ per rank, the last rank short
        patch=[("    bounds = chunk_bounds(flat.numel(), world)\n",
                "    size = -(-flat.numel() // world)\n"
                "    bounds = [(min(r * size, flat.numel()), min((r + 1) * size, flat.numel())) "
                "for r in range(world)]\n")],
        loses={"test_reduce_scatter_gradients_uneven": "has 77 elements, expected 76"},
        keeps=["test_reduce_scatter_gradients_basic"]),
    Bug("reduce_scatter_gradients", "never_reduced",  # each rank's own slice, divided by N
        patch=[("    dist.reduce_scatter(out, [padded(flat[a:b], chunk) for a, b in bounds])\n",
                "    out = padded(flat[bounds[rank][0]:bounds[rank][1]], chunk)\n")],
        loses={"test_reduce_scatter_gradients_basic": "the reduction did not happen",
               "test_reduce_scatter_gradients_uneven": "the reduction did not happen"}),

    # ------------------------------------------------------------------ 3. MiniFSDP (ZeRO-3)
    Bug("mini_fsdp", "unit_never_freed_after_backward",
        patch=[("        shard.grad = mine if shard.grad is None else shard.grad + mine\n"
                "        unit.free()\n",
                "        shard.grad = mine if shard.grad is None else shard.grad + mine\n")],
        loses={"test_mini_fsdp_basic": "free each unit after its backward",
               "test_mini_fsdp_memory_and_traffic": "units were unsharded at once"}),
    Bug("mini_fsdp", "unit_not_freed_after_forward",
        patch=[("        unit.free()\n"
                "        if isinstance(output, torch.Tensor) and output.requires_grad:\n",
                "        if isinstance(output, torch.Tensor) and output.requires_grad:\n")],
        loses={"test_mini_fsdp_basic": "free each unit after its forward",
               "test_mini_fsdp_memory_and_traffic": "in forward: ZeRO-3 keeps at most 2"}),
    Bug("mini_fsdp", "unit_gradients_summed_not_averaged",
        patch=[("mine = out[:stop - start] / self.world", "mine = out[:stop - start]")],
        loses={"test_mini_fsdp_basic": "2 times the average",
               "test_mini_fsdp_memory_and_traffic": "divide by N = 3"}),
    Bug("mini_fsdp", "not_gathered_before_backward",  # backward reads freed memory: autograd refuses
        patch=[("        if isinstance(output, torch.Tensor) and output.requires_grad:\n"
                "            output.register_hook(lambda grad: self._gather(unit, shard))\n", "")],
        loses={"test_mini_fsdp_basic": "parameters were used while freed",
               "test_mini_fsdp_memory_and_traffic": "before its forward and again before its backward"}),
    Bug("mini_fsdp", "shard_grad_replaced_not_added",  # the last backward's part only, with accumulation
        patch=[("shard.grad = mine if shard.grad is None else shard.grad + mine", "shard.grad = mine")],
        loses={"test_mini_fsdp_memory_and_traffic": "add the reduce-scattered part to an existing shard.grad"},
        keeps=["test_mini_fsdp_basic"]),
    Bug("mini_fsdp", "late_bound_forward_hooks",  # every forward hook sees the loop's last unit, head
        patch=[("            child.register_forward_pre_hook(lambda m, args, unit=unit, shard=shard: "
                "self._gather(unit, shard))\n",
                "            child.register_forward_pre_hook(lambda m, args: self._gather(unit, shard))\n"),
               ("                lambda m, args, output, unit=unit, shard=shard: self._after_forward(unit, shard, "
                "output))\n",
                "                lambda m, args, output: self._after_forward(unit, shard, output))\n")],
        loses={"test_mini_fsdp_basic": "bind each hook to its own with default arguments",
               "test_mini_fsdp_memory_and_traffic": "the hooks gather the wrong unit"}),
    Bug("mini_fsdp", "gather_copies_its_own_piece",  # every piece j filled from this rank's own shard
        patch=[("            buffer[a:b] = piece[:b - a]\n", "            buffer[a:b] = pieces[self.rank][:b - a]\n")],
        loses={"test_mini_fsdp_basic": "as gathered for its first forward",
               "test_mini_fsdp_memory_and_traffic": "piece j of the all-gather belongs at chunk_bounds"}),
    Bug("mini_fsdp", "unit_gathered_with_its_padding",  # head (34) on 3 ranks: 12, 11 + 1, 11 + 1
        patch=[("        for piece, (a, b) in zip(pieces, chunk_bounds(unit.numel, self.world), strict=True):\n"
                "            buffer[a:b] = piece[:b - a]\n",
                "        buffer.copy_(torch.cat(pieces)[:unit.numel])\n")],
        loses={"test_mini_fsdp_memory_and_traffic": "joined with their padding and cut at the end"},
        keeps=["test_mini_fsdp_basic"]),
    Bug("mini_fsdp", "units_sized_by_the_world",  # on a group of 2, lists of 4 pieces: the world's size
        patch=[("self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)",
                "self.world, self.rank = dist.get_world_size(), dist.get_rank(group)")],
        loses={"test_mini_fsdp_memory_and_traffic": "its output list is sized for the world's 4 ranks"},
        keeps=["test_mini_fsdp_basic"]),
    Bug("mini_fsdp", "torch_chunk_shards",  # a consistent layout, but torch.chunk's rule, not tensor_split's
        source=CEIL_BOUNDS + solution_code(ASSIGNMENT, "mini_fsdp").replace("chunk_bounds(", "ceil_bounds("),
        loses={"test_mini_fsdp_memory_and_traffic": "unit head: its shard has 12 elements, expected 11"},
        keeps=["test_mini_fsdp_basic"]),
    Bug("mini_fsdp", "all_reduce_instead_of_reduce_scatter",  # right gradients, 4(N-1)/N·S per step
        patch=[("        out = grad.new_empty(chunk)\n"
                "        dist.reduce_scatter(out, [padded(grad[a:b], chunk) for a, b in bounds], "
                "group=self.group)\n",
                "        dist.all_reduce(grad, group=self.group)\n"
                "        out = padded(grad[bounds[self.rank][0]:bounds[self.rank][1]], chunk)\n")],
        loses={"test_mini_fsdp_basic": "expected 3(N-1)/N·S",
               "test_mini_fsdp_memory_and_traffic": "one all-gather per unit in forward"}),
]

