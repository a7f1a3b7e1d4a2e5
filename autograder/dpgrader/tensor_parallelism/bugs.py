"""Planted bugs for 08_tensor_parallelism: each must lose the listed cells with a message saying why.

Four or more bugs per exercise. The layers build on the operators and the MLP and attention on the
layers, so a bug in a layer is planted in a notebook whose operators are the solution's
(`cells=OPERATORS`), and a bug in a block in one whose operators and layers are (`cells=LAYERS`) --
except the bugs that check a block's test names the earlier exercise to fix first (a block on a
broken layer). Covered, among others: f and g swapped, an all-reduce on the whole world instead of
the group, a weight slice taken by world rank, the row layer's bias added on every rank before the
all-reduce, f or g missing, an all-gather whose backward sums, extra collectives between the layers.
Each rule the text states has one: f reduces a copy of the gradient (not the gradient in place),
slices are copies (not views), a split N does not divide is refused with a ValueError that gives
both numbers, heads per rank come from the group's size.
"""

from dpgrader.planted import Bug, solution_code

ASSIGNMENT = "08_tensor_parallelism"
OPERATORS = {e: solution_code(ASSIGNMENT, e) for e in ("copy_to_tp", "reduce_from_tp", "gather_from_tp")}
LAYERS = {**OPERATORS, **{e: solution_code(ASSIGNMENT, e) for e in ("column_parallel_linear",
                                                                    "row_parallel_linear")}}

# --------------------------------------------------------------------------- f: copy_to_tp

F_NO_BACKWARD_ALL_REDUCE = Bug(
    "copy_to_tp", "f_no_backward_all_reduce",
    patch=[("        dist.all_reduce(total, group=ctx.group)\n", "")],
    loses={"test_copy_to_tp_basic": "issued no communication in backward, expected all_reduce",
           "test_copy_to_tp_groups": "issued no communication in backward, expected all_reduce"})

F_ALL_REDUCES_FORWARD_TOO = Bug(
    "copy_to_tp", "f_all_reduces_forward_too",
    patch=[("        ctx.group = group\n        return x",
            "        ctx.group = group\n        x = x.clone()\n"
            "        dist.all_reduce(x, group=group)\n        return x")],
    loses={"test_copy_to_tp_basic": "in forward, expected no communication (f: the identity forward"})

F_ON_THE_WORLD = Bug(
    "copy_to_tp", "f_on_the_world",
    patch=[("dist.all_reduce(total, group=ctx.group)", "dist.all_reduce(total)")],
    loses={"test_copy_to_tp_groups": "ran on ranks (0, 1, 2, 3), expected its tensor-parallel group (0, 1)"},
    keeps=["test_copy_to_tp_basic"])

F_REDUCES_THE_GRADIENT_IN_PLACE = Bug(
    "copy_to_tp", "f_reduces_the_gradient_in_place",
    patch=[("        total = grad.clone()\n        dist.all_reduce(total, group=ctx.group)\n"
            "        return total, None",
            "        dist.all_reduce(grad, group=ctx.group)\n        return grad, None")],
    loses={"test_copy_to_tp_basic": "backward changed the gradient it was handed, in place"})

F_DOES_G = Bug(  # half of "f and g swapped"
    "copy_to_tp", "f_does_g",
    patch=[("        ctx.group = group\n        return x",
            "        total = x.clone()\n        dist.all_reduce(total, group=group)\n        return total"),
           ("        total = grad.clone()\n        dist.all_reduce(total, group=ctx.group)\n"
            "        return total, None", "        return grad, None")],
    loses={"test_copy_to_tp_basic": "in forward, expected no communication"})

# --------------------------------------------------------------------------- g: reduce_from_tp

G_ALL_REDUCES_BACKWARD_TOO = Bug(
    "reduce_from_tp", "g_all_reduces_backward_too",
    patch=[("        total = x.clone()\n", "        ctx.group = group\n        total = x.clone()\n"),
           ("        return grad, None",
            "        grad = grad.clone()\n        dist.all_reduce(grad, group=ctx.group)\n"
            "        return grad, None")],
    loses={"test_reduce_from_tp_basic": "in backward, expected no communication (g: one all-reduce forward, "
                                        "the identity backward)"})

G_IN_PLACE_ON_THE_INPUT = Bug(
    "reduce_from_tp", "g_in_place_on_the_input",
    patch=[("        total = x.clone()\n        dist.all_reduce(total, group=group)\n        return total",
            "        dist.all_reduce(x, group=group)\n        return x")],
    loses={"test_reduce_from_tp_basic": "changed its input x in place"})

G_ON_THE_WORLD = Bug(
    "reduce_from_tp", "g_on_the_world",
    patch=[("dist.all_reduce(total, group=group)", "dist.all_reduce(total)")],
    loses={"test_reduce_from_tp_groups": "expected its tensor-parallel group (0, 1) -- the whole world"},
    keeps=["test_reduce_from_tp_basic"])

G_DOES_F = Bug(  # the other half of "f and g swapped"
    "reduce_from_tp", "g_does_f",
    patch=[("        total = x.clone()\n        dist.all_reduce(total, group=group)\n        return total",
            "        ctx.group = group\n        return x"),
           ("        return grad, None",
            "        total = grad.clone()\n        dist.all_reduce(total, group=ctx.group)\n"
            "        return total, None")],
    loses={"test_reduce_from_tp_basic": "issued no communication in forward, expected all_reduce"})

G_FLOAT32_BUFFER = Bug(  # torch.zeros(shape) is float32 whatever x is
    "reduce_from_tp", "g_float32_buffer",
    patch=[("        total = x.clone()\n", "        total = torch.zeros(x.shape)\n        total += x\n")],
    loses={"test_reduce_from_tp_basic": "half the bytes: a float32 buffer"})

# --------------------------------------------------------------------------- gather_from_tp

GATHER_BACKWARD_SUMS = Bug(
    "gather_from_tp", "gather_backward_sums",
    patch=[("        n, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)\n",
            "        n, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)\n"
            "        grad = grad.clone()\n        dist.all_reduce(grad, group=ctx.group)\n")],
    loses={"test_gather_from_tp_basic": "in backward, expected no communication"})

GATHER_SLICE_BY_WORLD_RANK = Bug(
    "gather_from_tp", "gather_slice_by_world_rank",
    patch=[("dist.get_rank(ctx.group)", "dist.get_rank()")],
    loses={"test_gather_from_tp_groups": "raised on the ranks of group [2, 3] whose world rank is 2 or more: "
                                         "IndexError: tuple index out of range -- a group of 2 has slices 0 to 1: "
                                         "was the index the world rank (dist.get_rank()) instead of the rank in "
                                         "the group"},
    keeps=["test_gather_from_tp_basic"])

GATHER_ALONG_DIM_0 = Bug(
    "gather_from_tp", "gather_along_dim_0",
    patch=[("return torch.cat(pieces, dim=-1)", "return torch.cat(pieces)")],
    loses={"test_gather_from_tp_basic": "output has shape (6, 2), expected (3, 4)"})

GATHER_BACKWARD_RETURNS_ALL = Bug(
    "gather_from_tp", "gather_backward_returns_the_whole_gradient",
    patch=[("        return grad.chunk(n, dim=-1)[r].contiguous(), None", "        return grad, None")],
    loses={"test_gather_from_tp_basic": "returned an invalid gradient"})

# --------------------------------------------------------------------------- ColumnParallelLinear

COLUMN_WITHOUT_F = Bug(
    "column_parallel_linear", "column_without_f",
    patch=[("F.linear(copy_to_tp(x, self.group), self.weight, self.bias)",
            "F.linear(x, self.weight, self.bias)")],
    loses={"test_column_parallel_linear_basic": "is f (copy_to_tp) missing?"},
    cells=OPERATORS)

COLUMN_SLICE_BY_WORLD_RANK = Bug(
    "column_parallel_linear", "column_slice_by_world_rank",
    patch=[("n, r = dist.get_world_size(group), dist.get_rank(group)\n        rows",
            "n, r = dist.get_world_size(group), dist.get_rank()\n        rows")],
    loses={"test_column_parallel_linear_groups": "instead of the rank in the group (dist.get_rank(group))"},
    keeps=["test_column_parallel_linear_basic"],
    cells=OPERATORS)

COLUMN_IGNORES_GATHER_OUTPUT = Bug(
    "column_parallel_linear", "column_ignores_gather_output",
    patch=[("        if self.gather_output:\n            y = gather_from_tp(y, self.group)\n", "")],
    loses={"test_column_parallel_linear_groups": "only this rank's slice -- the output must be gathered"},
    keeps=["test_column_parallel_linear_basic"],
    cells=OPERATORS)

COLUMN_F_ON_THE_WORLD = Bug(
    "column_parallel_linear", "column_f_on_the_world",
    patch=[("copy_to_tp(x, self.group)", "copy_to_tp(x)")],
    loses={"test_column_parallel_linear_groups":
           "summed over every rank of the world, not over the layer's group"},
    keeps=["test_column_parallel_linear_basic"],
    cells=OPERATORS)

COLUMN_SLICE_IS_A_VIEW = Bug(
    "column_parallel_linear", "column_slice_is_a_view",
    patch=[("self.weight = nn.Parameter(linear.weight.detach()[start:stop].clone())",
            "self.weight = nn.Parameter(linear.weight.data[start:stop])")],
    loses={"test_column_parallel_linear_basic": "rank 0's weight is a view of the unsharded module's parameter, "
                                                "not a copy: it keeps all 96 values of the full tensor alive for "
                                                "its 48"},
    cells=OPERATORS)

COLUMN_DROPS_THE_REMAINDER = Bug(
    "column_parallel_linear", "column_drops_the_remainder",
    patch=[("        if linear.out_features % n:\n            raise ValueError(f\"{linear.out_features} output "
            "features cannot be split evenly over {n} ranks\")\n", "")],
    loses={"test_column_parallel_linear_groups": "ColumnParallelLinear of an nn.Linear(8, 10) over 4 ranks: rank 0 "
                                                 "built the module: expected a ValueError"},
    keeps=["test_column_parallel_linear_basic"],
    cells=OPERATORS)

# --------------------------------------------------------------------------- RowParallelLinear

ROW_BIAS_ON_EVERY_RANK = Bug(
    "row_parallel_linear", "row_bias_added_on_every_rank",
    patch=[("        y = reduce_from_tp(F.linear(x, self.weight), self.group)\n"
            "        if self.bias is not None:\n            y = y + self.bias\n",
            "        y = reduce_from_tp(F.linear(x, self.weight, self.bias), self.group)\n")],
    loses={"test_row_parallel_linear_basic": "the bias was added on every rank before the all-reduce"},
    cells=OPERATORS)

ROW_WITHOUT_G = Bug(
    "row_parallel_linear", "row_without_g",
    patch=[("reduce_from_tp(F.linear(x, self.weight), self.group)", "F.linear(x, self.weight)")],
    loses={"test_row_parallel_linear_basic": "is g (reduce_from_tp) missing?"},
    cells=OPERATORS)

ROW_SLICES_X_BY_HAND = Bug(
    "row_parallel_linear", "row_slices_x_by_hand",
    patch=[("            x = scatter_to_tp(x, self.group)",
            "            n, r = dist.get_world_size(self.group), dist.get_rank(self.group)\n"
            "            x = x.chunk(n, dim=-1)[r]")],
    loses={"test_row_parallel_linear_groups": "use scatter_to_tp, whose backward all-gathers"},
    keeps=["test_row_parallel_linear_basic"],
    cells=OPERATORS)

ROW_G_ON_THE_WORLD = Bug(
    "row_parallel_linear", "row_g_on_the_world",
    patch=[("reduce_from_tp(F.linear(x, self.weight), self.group)",
            "reduce_from_tp(F.linear(x, self.weight))")],
    loses={"test_row_parallel_linear_groups":
           "summed over every rank of the world, not over the layer's group"},
    keeps=["test_row_parallel_linear_basic"],
    cells=OPERATORS)

ROW_SLICE_IS_A_VIEW = Bug(
    "row_parallel_linear", "row_slice_is_a_view",
    patch=[("nn.Parameter(linear.weight.detach()[:, r * cols:(r + 1) * cols].clone())",
            "nn.Parameter(linear.weight.detach()[:, r * cols:(r + 1) * cols])")],
    loses={"test_row_parallel_linear_basic": "rank 0's weight is a view of the unsharded module's parameter, not "
                                             "a copy"},
    cells=OPERATORS)

ROW_REFUSES_WITHOUT_SAYING_WHY = Bug(
    "row_parallel_linear", "row_refuses_without_the_numbers",
    patch=[('raise ValueError(f"{linear.in_features} input features cannot be split evenly over {n} ranks")',
            'raise ValueError("the input features cannot be split evenly")')],
    loses={"test_row_parallel_linear_groups": "a ValueError, but its message should say why, giving the numbers "
                                              "10 (input features) and 4 (ranks)"},
    keeps=["test_row_parallel_linear_basic"],
    cells=OPERATORS)

# --------------------------------------------------------------------------- TensorParallelMLP

MLP_GATHERS_BETWEEN_LAYERS = Bug(
    "tensor_parallel_mlp", "mlp_gathers_between_the_layers",
    patch=[("gather_output=False)", "gather_output=True)"),
           ("input_is_parallel=True)", "input_is_parallel=False)")],
    loses={"test_tensor_parallel_mlp_basic": "in forward, expected all_reduce (exactly one all-reduce",
           "test_tensor_parallel_mlp_training": "in forward, expected all_reduce"},
    cells=LAYERS)

MLP_LAYERS_IN_A_LIST = Bug(
    "tensor_parallel_mlp", "mlp_layers_in_a_plain_list",
    patch=[("        self.fc1 = ColumnParallelLinear(mlp.fc1, group, gather_output=False)\n"
            "        self.act = nn.GELU()\n"
            "        self.fc2 = RowParallelLinear(mlp.fc2, group, input_is_parallel=True)",
            "        self.layers = [ColumnParallelLinear(mlp.fc1, group), nn.GELU(),\n"
            "                       RowParallelLinear(mlp.fc2, group)]"),
           ("        return self.fc2(self.act(self.fc1(x)))",
            "        for layer in self.layers:\n            x = layer(x)\n        return x")],
    loses={"test_tensor_parallel_mlp_basic": "a plain list hides them from .parameters()",
           "test_tensor_parallel_mlp_training": "has parameters [], expected"},
    cells=LAYERS)

MLP_ACTIVATION_AFTER_FC2 = Bug(
    "tensor_parallel_mlp", "mlp_activation_after_fc2",
    patch=[("return self.fc2(self.act(self.fc1(x)))", "return self.act(self.fc2(self.fc1(x)))")],
    loses={"test_tensor_parallel_mlp_basic": "TensorParallelMLP: rank 0's output is",
           "test_tensor_parallel_mlp_training": "the loss of step 0, before any update, is"},
    cells=LAYERS)

MLP_KEEPS_THE_FULL_MLP = Bug(
    "tensor_parallel_mlp", "mlp_keeps_the_full_mlp",
    patch=[("        self.act = nn.GELU()\n", "        self.act = nn.GELU()\n        self.mlp = mlp\n")],
    loses={"test_tensor_parallel_mlp_basic": "keep only your slices as parameters"},
    cells=LAYERS)

BLOCK_ON_BROKEN_LAYERS = {**OPERATORS, "column_parallel_linear": COLUMN_WITHOUT_F.cell_sources(ASSIGNMENT)[
    "column_parallel_linear"], "row_parallel_linear": solution_code(ASSIGNMENT, "row_parallel_linear")}

MLP_ON_A_COLUMN_LAYER_WITHOUT_F = Bug(  # the MLP is right; the test must send the learner back to exercise 4
    "tensor_parallel_mlp", "mlp_on_a_column_layer_without_f",
    cells={**BLOCK_ON_BROKEN_LAYERS, "tensor_parallel_mlp": solution_code(ASSIGNMENT, "tensor_parallel_mlp")},
    loses={"test_tensor_parallel_mlp_basic": "TensorParallelMLP is built on your ColumnParallelLinear (exercise 4), "
                                             "which fails its own test: fix ColumnParallelLinear first",
           "test_tensor_parallel_mlp_training": "fix ColumnParallelLinear first"})

# --------------------------------------------------------------------------- TensorParallelAttention

ATTENTION_WITHOUT_HEAD_CHECK = Bug(
    "tensor_parallel_attention", "attention_without_the_heads_check",
    patch=[("        if attention.n_heads % n:\n"
            "            raise ValueError(f\"{attention.n_heads} heads cannot be split evenly over "
            "{n} ranks\")\n",
            "")],
    loses={"test_tensor_parallel_attention_training": "TensorParallelAttention of 6 heads over 4 ranks: rank 0 "
                                                      "built the module: expected a ValueError"},
    keeps=["test_tensor_parallel_attention_basic"],
    cells=LAYERS)

ATTENTION_REFUSES_WITHOUT_SAYING_WHY = Bug(
    "tensor_parallel_attention", "attention_refuses_without_the_numbers",
    patch=[('raise ValueError(f"{attention.n_heads} heads cannot be split evenly over {n} ranks")',
            'raise ValueError("the heads cannot be split evenly over the ranks")')],
    loses={"test_tensor_parallel_attention_training": "a ValueError, but its message should say why, giving the "
                                                      "numbers 6 (heads) and 4 (ranks)"},
    keeps=["test_tensor_parallel_attention_basic"],
    cells=LAYERS)

ATTENTION_HEADS_FROM_THE_WORLD_SIZE = Bug(
    "tensor_parallel_attention", "attention_heads_from_the_world_size",
    patch=[("        n = dist.get_world_size(group)\n", "        n = dist.get_world_size()\n")],
    loses={"test_tensor_parallel_attention_training": "the forward already differs from the unsharded module's -- "
                                                      "each rank computed 1 head(s), n_heads / N with N the "
                                                      "world's 4 ranks"},
    keeps=["test_tensor_parallel_attention_basic"],
    cells=LAYERS)

ATTENTION_ON_A_ROW_LAYER_ADDING_THE_BIAS_TWICE = Bug(  # attention right, RowParallelLinear wrong (exercise 5)
    "tensor_parallel_attention", "attention_on_a_row_layer_adding_the_bias_on_every_rank",
    cells={**OPERATORS, "column_parallel_linear": solution_code(ASSIGNMENT, "column_parallel_linear"),
           "row_parallel_linear": ROW_BIAS_ON_EVERY_RANK.cell_sources(ASSIGNMENT)["row_parallel_linear"],
           "tensor_parallel_attention": solution_code(ASSIGNMENT, "tensor_parallel_attention")},
    loses={"test_tensor_parallel_attention_basic": "TensorParallelAttention is built on your RowParallelLinear "
                                                   "(exercise 5), which fails its own test: fix "
                                                   "RowParallelLinear first"})

ATTENTION_ALL_HEADS_ON_EVERY_RANK = Bug(
    "tensor_parallel_attention", "attention_all_heads_on_every_rank",
    patch=[("self.heads = attention.n_heads // n", "self.heads = attention.n_heads")],
    loses={"test_tensor_parallel_attention_basic": "each rank computed all 4 heads on its slice of qkv"},
    cells=LAYERS)

ATTENTION_GATHERS_THE_HEADS = Bug(
    "tensor_parallel_attention", "attention_gathers_the_heads",
    patch=[("self.heads = attention.n_heads // n", "self.heads = attention.n_heads"),
           ("gather_output=False)", "gather_output=True)"),
           ("input_is_parallel=True)", "input_is_parallel=False)")],
    loses={"test_tensor_parallel_attention_basic": "in forward, expected all_reduce (exactly one all-reduce",
           "test_tensor_parallel_attention_training": "in forward, expected all_reduce"},
    cells=LAYERS)

ATTENTION_KEEPS_THE_FULL_MODULE = Bug(
    "tensor_parallel_attention", "attention_keeps_the_full_module",
    patch=[("        self.heads = attention.n_heads // n\n",
            "        self.heads = attention.n_heads // n\n        self.attention = attention\n")],
    loses={"test_tensor_parallel_attention_basic": "keep only your slices as parameters"},
    cells=LAYERS)

F_AND_G_SWAPPED = Bug(  # f does what g should, g what f should: one notebook
    "copy_to_tp", "f_and_g_swapped", patch=F_DOES_G.patch,
    cells={"reduce_from_tp": G_DOES_F.cell_sources(ASSIGNMENT)["reduce_from_tp"]},
    loses={**F_DOES_G.loses, **G_DOES_F.loses})

BUGS = [
    F_NO_BACKWARD_ALL_REDUCE, F_ALL_REDUCES_FORWARD_TOO, F_ON_THE_WORLD, F_REDUCES_THE_GRADIENT_IN_PLACE,
    F_AND_G_SWAPPED,
    G_ALL_REDUCES_BACKWARD_TOO, G_IN_PLACE_ON_THE_INPUT, G_ON_THE_WORLD, G_DOES_F, G_FLOAT32_BUFFER,
    GATHER_BACKWARD_SUMS, GATHER_SLICE_BY_WORLD_RANK, GATHER_ALONG_DIM_0, GATHER_BACKWARD_RETURNS_ALL,
    COLUMN_WITHOUT_F, COLUMN_SLICE_BY_WORLD_RANK, COLUMN_IGNORES_GATHER_OUTPUT, COLUMN_F_ON_THE_WORLD,
    COLUMN_SLICE_IS_A_VIEW, COLUMN_DROPS_THE_REMAINDER,
    ROW_BIAS_ON_EVERY_RANK, ROW_WITHOUT_G, ROW_SLICES_X_BY_HAND, ROW_G_ON_THE_WORLD, ROW_SLICE_IS_A_VIEW,
    ROW_REFUSES_WITHOUT_SAYING_WHY,
    MLP_GATHERS_BETWEEN_LAYERS, MLP_LAYERS_IN_A_LIST, MLP_ACTIVATION_AFTER_FC2, MLP_KEEPS_THE_FULL_MLP,
    MLP_ON_A_COLUMN_LAYER_WITHOUT_F,
    ATTENTION_WITHOUT_HEAD_CHECK, ATTENTION_ALL_HEADS_ON_EVERY_RANK, ATTENTION_GATHERS_THE_HEADS,
    ATTENTION_KEEPS_THE_FULL_MODULE, ATTENTION_REFUSES_WITHOUT_SAYING_WHY, ATTENTION_HEADS_FROM_THE_WORLD_SIZE,
    ATTENTION_ON_A_ROW_LAYER_ADDING_THE_BIAS_TWICE,
]
