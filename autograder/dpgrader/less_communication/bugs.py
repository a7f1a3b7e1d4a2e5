"""Planted bugs for 11_less_communication: each must lose the listed cells with a message saying why.

Realistic mistakes, at least four per exercise: top-k of the values instead of the magnitudes, int64
indices, signs dropped, k off by one, no check of k, a decompressed tensor sized by its largest index;
no error feedback, a residual that keeps what was sent, an average before compression, a dense
all-reduce instead of the all-gather, a sum for an average, k split over the ranks, indices sent as
floats, a residual of the gradient alone; PowerSGD without error feedback, with errors never kept or kept
only for the compressed matrices, every matrix compressed, Q or the uncompressed sum not averaged, no warm
start, the decompressed matrix rebound instead of copied; local SGD averaging every step, counting steps
from 0, one all-reduce per tensor, a sum, no write-back, a float32 buffer; a parameter server off by one in the staleness, applying the gradient to the stale
version, ignoring the delay, serving workers in the wrong order, workers on the wrong batches.
"""

from dpgrader.planted import Bug, solution_code

ASSIGNMENT = "11_less_communication"
TOPK_COMPRESS = ["test_topk_compress_basic", "test_topk_compress_shapes"]
TOPK_ALL_REDUCE = ["test_topk_all_reduce_one_step", "test_topk_all_reduce_error_feedback"]
POWERSGD = ["test_powersgd_hook_uncompressed", "test_powersgd_hook_rank_one"]
LOCAL_SGD = ["test_local_sgd_h1", "test_local_sgd_every_h"]


# topk_all_reduce calls the learner's topk_compress and topk_decompress: its bugs are planted next to their
# solution
SOLVED_TOPK = {"topk_compress": solution_code(ASSIGNMENT, "topk_compress")}


def _both(cells, fragment):
    return {cell: fragment for cell in cells}


def _topk_bug(name, patch, loses, keeps=()):
    return Bug("topk_all_reduce", name, patch=patch, cells=dict(SOLVED_TOPK), loses=loses, keeps=list(keeps))


BUGS = [
    # -- topk_compress / topk_decompress --------------------------------------------------------------
    Bug("topk_compress", "largest_values_not_magnitudes",
        patch=[("torch.topk(flat.abs(), k)", "torch.topk(flat, k)")],
        loses=_both(TOPK_COMPRESS, "top-k keeps the largest magnitudes")),
    Bug("topk_compress", "int64_indices",
        patch=[("positions.to(torch.int32)", "positions")],
        loses=_both(TOPK_COMPRESS, "expected torch.int32 (8 bytes per index instead of 4)")),
    Bug("topk_compress", "magnitudes_sent_as_values",
        patch=[("return flat[positions], positions", "return flat[positions].abs(), positions")],
        loses=_both(TOPK_COMPRESS, "keep the signs")),
    Bug("topk_compress", "one_entry_too_few",
        patch=[("torch.topk(flat.abs(), k)", "torch.topk(flat.abs(), k - 1)")],
        loses=_both(TOPK_COMPRESS, "one value and one index per kept entry")),
    Bug("topk_compress", "no_check_of_k",
        patch=[("    if not 1 <= k <= flat.numel():\n", "    if False:\n")],
        loses={"test_topk_compress_shapes": "expected a ValueError"}, keeps=["test_topk_compress_basic"]),
    Bug("topk_compress", "decompress_sized_by_the_largest_index",
        patch=[("torch.zeros(numel, dtype=values.dtype, device=values.device)",
                "torch.zeros(int(indices.max()) + 1, dtype=values.dtype, device=values.device)")],
        loses=_both(TOPK_COMPRESS, "has shape")),

    # -- topk_all_reduce (next to the solution of topk_compress, which it calls) ---------------------------
    _topk_bug("topk_without_error_feedback",
              patch=[("wanted = grad + residual", "wanted = grad.clone()")],
              loses={"test_topk_all_reduce_error_feedback": "(error feedback)"},
              keeps=["test_topk_all_reduce_one_step"]),
    _topk_bug("residual_not_reset",
              patch=[("new_residual = wanted - topk_decompress(values, indices, wanted.numel())",
                      "new_residual = wanted.clone()")],
              loses=_both(TOPK_ALL_REDUCE, "residual not reset")),
    _topk_bug("averaging_before_compression",
              patch=[("wanted = grad + residual", "wanted = (grad + residual) / dist.get_world_size()"),
                     ("return total / world_size, new_residual", "return total, new_residual")],
              loses=_both(TOPK_ALL_REDUCE, "must equal gradient + old residual")),
    _topk_bug("dense_all_reduce",
              patch=[("    dist.all_gather(gathered_values, values)\n"
                      "    dist.all_gather(gathered_indices, indices)\n"
                      "    total = torch.zeros_like(wanted)\n"
                      "    for their_values, their_indices in zip(gathered_values, gathered_indices, "
                      "strict=True):\n"
                      "        total += topk_decompress(their_values, their_indices, wanted.numel())\n",
                      "    total = topk_decompress(values, indices, wanted.numel())\n"
                      "    dist.all_reduce(total)\n")],
              loses=_both(TOPK_ALL_REDUCE, "a sum of sparse vectors is not sparse")),
    _topk_bug("indices_sent_as_float64",  # the indices cast to the values' dtype for the all-gather
              patch=[("    gathered_indices = [torch.empty_like(indices) for _ in range(world_size)]\n",
                      "    gathered_indices = [torch.empty_like(values) for _ in range(world_size)]\n"),
                     ("    dist.all_gather(gathered_indices, indices)\n",
                      "    dist.all_gather(gathered_indices, indices.to(values.dtype))\n")],
              loses=_both(TOPK_ALL_REDUCE, "not cast to int64 or to the values' float dtype")),
    _topk_bug("residual_from_the_gradient_alone",  # gradient - sent: the old residual is lost
              patch=[("new_residual = wanted - topk_decompress(values, indices, wanted.numel())",
                      "new_residual = grad - topk_decompress(values, indices, wanted.numel())")],
              loses={"test_topk_all_reduce_error_feedback": "the new residual is gradient - sent"},
              keeps=["test_topk_all_reduce_one_step"]),
    _topk_bug("topk_sum_not_average",
              patch=[("return total / world_size, new_residual", "return total, new_residual")],
              loses=_both(TOPK_ALL_REDUCE, "x the expected values")),
    _topk_bug("k_split_over_ranks",
              patch=[("values, indices = topk_compress(wanted, k)",
                      "values, indices = topk_compress(wanted, max(1, k // dist.get_world_size()))")],
              loses=_both(TOPK_ALL_REDUCE, "positions of largest |gradient + old residual|")),

    # -- powersgd_hook ---------------------------------------------------------------------------------
    Bug("powersgd_hook", "powersgd_without_error_feedback",
        patch=[("            g += state.errors[p]\n", "            pass\n")],
        loses={"test_powersgd_hook_rank_one": "the error ignores the previous one"},
        keeps=["test_powersgd_hook_uncompressed"]),
    Bug("powersgd_hook", "errors_never_kept",
        patch=[("            state.errors[p] = w - g\n", "            pass\n")],
        loses={"test_powersgd_hook_rank_one": "state.errors has no entry for this parameter"},
        keeps=["test_powersgd_hook_uncompressed"]),
    Bug("powersgd_hook", "every_matrix_compressed",
        patch=[("if compressible(tuple(g.shape), state.matrix_rank)]", "if g.dim() >= 2]"),
               ("if not compressible(tuple(g.shape), state.matrix_rank)]", "if g.dim() < 2]")],
        loses=_both(POWERSGD, "compress a matrix only when its factors are smaller")),
    Bug("powersgd_hook", "q_not_averaged",
        patch=[("        flat_q /= world_size\n", "")],
        loses={"test_powersgd_hook_rank_one": "Q is all-reduced as a sum over ranks; divide it by N = 2"},
        keeps=["test_powersgd_hook_uncompressed"]),
    Bug("powersgd_hook", "decompressed_matrix_rebound",  # M = ... rebinds the name; the bucket keeps M
        patch=[("            M.copy_(P_hat @ state.qs[p].T)\n", "            M = P_hat @ state.qs[p].T\n")],
        loses={"test_powersgd_hook_rank_one": "only rebinds the name M"},
        keeps=["test_powersgd_hook_uncompressed"]),
    Bug("powersgd_hook", "errors_only_for_compressed_matrices",
        patch=[("        for p, g, w in zip(params, grads, wanted, strict=True):\n"
                "            state.errors[p] = w - g\n",
                "        for p, g, w in zip(params, grads, wanted, strict=True):\n"
                "            if compressible(tuple(g.shape), state.matrix_rank):\n"
                "                state.errors[p] = w - g\n")],
        loses={"test_powersgd_hook_rank_one": "it travels uncompressed at rank 1, and needs one"},
        keeps=["test_powersgd_hook_uncompressed"]),
    Bug("powersgd_hook", "uncompressed_sum_not_averaged",
        patch=[("average, offset = flat / world_size, 0", "average, offset = flat, 0")],
        loses={"test_powersgd_hook_uncompressed": "should train like one process",
               "test_powersgd_hook_rank_one": "x the expected values"}),
    Bug("powersgd_hook", "no_warm_start",
        patch=[("            if p not in state.qs:\n", "            if True:\n")],
        loses={"test_powersgd_hook_rank_one": "the simulation of"},
        keeps=["test_powersgd_hook_uncompressed"]),

    # -- local_sgd -------------------------------------------------------------------------------------
    Bug("local_sgd", "averages_every_step",
        patch=[("            if t % H == 0:\n", "            if True:\n")],
        loses={"test_local_sgd_every_h": "average after every H = 3 steps only"},
        keeps=["test_local_sgd_h1"]),
    Bug("local_sgd", "steps_counted_from_zero",
        patch=[("enumerate(batches, start=1)", "enumerate(batches)")],
        loses={"test_local_sgd_every_h": "are the steps counted from 1"},
        keeps=["test_local_sgd_h1"]),
    Bug("local_sgd", "one_all_reduce_per_tensor",
        patch=[("                flat = torch.cat([p.reshape(-1) for p in params])\n"
                "                dist.all_reduce(flat)\n                flat /= world_size\n"
                "                offset = 0\n                for p in params:\n"
                "                    p.copy_(flat[offset:offset + p.numel()].view_as(p))\n"
                "                    offset += p.numel()\n",
                "                for p in params:\n                    dist.all_reduce(p)\n"
                "                    p /= world_size\n")],
        loses=_both(LOCAL_SGD, "one per parameter tensor")),
    Bug("local_sgd", "parameters_summed_not_averaged",
        patch=[("                flat /= world_size\n", "")],
        loses={"test_local_sgd_h1": "should train like one process"}),
    Bug("local_sgd", "float32_buffer",  # the flat copy in float32: half the bytes, every parameter rounded
        patch=[("                flat = torch.cat([p.reshape(-1) for p in params])\n",
                "                flat = torch.cat([p.reshape(-1) for p in params]).float()\n")],
        loses=_both(LOCAL_SGD, "the flat tensor is float32")),
    Bug("local_sgd", "average_not_written_back",
        patch=[("                    p.copy_(flat[offset:offset + p.numel()].view_as(p))\n", "")],
        loses={"test_local_sgd_h1": "should train like one process",
               "test_local_sgd_every_h": "the average written back into the model"}),

    # -- async_sgd -------------------------------------------------------------------------------------
    Bug("async_sgd", "staleness_off_by_one",
        patch=[("dist.send(versions[max(0, t - delay)], dst=worker)",
                "dist.send(versions[max(0, t - delay - 1)], dst=worker)"),
               ("versions.pop(t - delay, None)", "versions.pop(t - delay - 1, None)")],
        loses={"test_async_sgd_no_delay": "at version t, the newest",
               "test_async_sgd_delay": "expected version max(0, t - 2)"}),
    Bug("async_sgd", "gradient_applied_to_the_stale_version",
        patch=[("versions[t + 1] = versions[t] - lr * gradient",
                "versions[t + 1] = versions[max(0, t - delay)] - lr * gradient")],
        loses={"test_async_sgd_delay": "apply it to the latest version"},
        keeps=["test_async_sgd_no_delay"]),
    Bug("async_sgd", "delay_ignored",
        patch=[("dist.send(versions[max(0, t - delay)], dst=worker)", "dist.send(versions[t], dst=worker)")],
        loses={"test_async_sgd_delay": "the parameters of delay 0"},
        keeps=["test_async_sgd_no_delay"]),
    Bug("async_sgd", "workers_served_in_reverse_order",
        patch=[("worker = 1 + t % workers", "worker = workers - t % workers")],
        loses={"test_async_sgd_no_delay": "update t is worker 1 + t mod 2's"}),
    Bug("async_sgd", "workers_count_their_own_batches",
        patch=[("            x, y = batches[t]\n", "            x, y = batches[t // workers]\n")],
        loses={"test_async_sgd_no_delay": "update t computed on batches[t]"}),
]
