"""Planted bugs for 01_first_principles: each must lose the listed cells with a message saying why.

The six exercises are independent, so each graded variant plants one bug in every exercise (five
variants, five bugs per exercise, 30 bugs in five notebook executions).
"""

from dpgrader.planted import Bug, Variant

# ---- shard_indices ------------------------------------------------------------------------------
SPREAD = ("        base, extra = divmod(n, world_size)\n"
          "        start = rank * base + min(rank, extra)\n"
          "        return torch.arange(start, start + base + (rank < extra))\n")
PAD = "        return torch.arange(rank * size, (rank + 1) * size) % n\n"
DROP = "        return torch.arange(rank * size, (rank + 1) * size)\n"

# ---- data_parallel_gradient ----------------------------------------------------------------------
WEIGHTED = "            t += g * (len(xs) / len(x))  # weight n_k / B\n"
LOCAL_GRADIENT = "        grads = torch.autograd.grad(loss_fn(model(xs), ys), weights)\n"
BACKWARD = ("        loss_fn(model(xs), ys).backward()  # accumulates into .grad, never zeroed\n"
            "        grads = [w.grad for w in weights]\n")

# ---- simulated_dp_step ---------------------------------------------------------------------------
AVERAGE = "    average = [sum(s * g[i] for s, g in zip(sizes, grads, strict=True)) / len(x) for i in range(len(grads[0]))]\n"

# ---- allreduce_sgd_step --------------------------------------------------------------------------
SCALE_AND_REDUCE = ("        g = g * (len(xs) / len(x))  # this rank's share of the global mean\n"
                    "        dist.all_reduce(g)\n")
REDUCE_THEN_DIVIDE = ("        dist.all_reduce(g)\n"
                      "        g = g / world\n")
LOCAL_STEP = ("    if len(xs):\n"
              "        grads = torch.autograd.grad(loss_fn(model(xs), ys), weights)\n"
              "    else:  # no samples here, but this rank still joins every all-reduce\n"
              "        grads = [torch.zeros_like(w) for w in weights]\n")

# ---- sync_batch_norm -----------------------------------------------------------------------------
STATS = "    stats = torch.cat([count, x64.sum(0), (x64 * x64).sum(0)])\n"
MEAN_VAR = ("    mean = stats[1:1 + c] / stats[0]\n"
            "    var = stats[1 + c:] / stats[0] - mean * mean\n")

# ---- memory_per_gpu ------------------------------------------------------------------------------
GRADIENTS = '        "gradients": weight_bytes * n_params,\n'
OPTIMIZER = '        "optimizer": (master_bytes + 4 * moments[optimizer]) * n_params,\n'
LARGEST = "    largest_shard = -(-global_batch // world_size)  # ceil: the fullest rank's samples\n"


BUGS = [
    Variant("sums_instead_of_averaging", [
        Bug("shard_indices", "last_rank_takes_the_remainder",
            patch=[(SPREAD, "        size = n // world_size\n"
                            "        end = n if rank == world_size - 1 else (rank + 1) * size\n"
                            "        return torch.arange(rank * size, end)\n")],
            loses={"test_shard_indices_basic": "rank 0: shard_indices(10, rank, 4) has shape (2,), expected (3,)",
                   "test_shard_indices_policies": "rank 3: shard_indices(3, 3, 4) has shape (3,), expected (0,)"}),
        Bug("data_parallel_gradient", "sums_shard_gradients",
            patch=[(WEIGHTED, "            t += g\n")],
            loses={"test_data_parallel_gradient_basic": "(4x the expected values): it is the sum of the shard "
                                                        "gradients",
                   "test_data_parallel_gradient_uneven": "the gradient of 0.weight"}),
        Bug("simulated_dp_step", "sums_worker_gradients",
            patch=[(AVERAGE, "    average = [sum(g[i] for g in grads) for i in range(len(grads[0]))]\n")],
            loses={"test_simulated_dp_step_basic": "(the update is 3.41x the reference update)",
                   "test_simulated_dp_step_uneven": "replica 0"}),
        Bug("allreduce_sgd_step", "sums_rank_gradients",
            patch=[("        g = g * (len(xs) / len(x))  # this rank's share of the global mean\n", "")],
            loses={"test_allreduce_sgd_step_basic": "rank 0 after 2 steps: weight",
                   "test_allreduce_sgd_step_uneven": "rank 0, 10 samples over 3 ranks"}),
        Bug("sync_batch_norm", "local_statistics_only",  # a rewrite: no communication, float32 statistics
            source="def sync_batch_norm(x, weight, bias, eps=1e-5):\n"
                   "    mean = x.mean(0)\n"
                   "    var = x.var(0, unbiased=False)\n"
                   "    return (x - mean) / torch.sqrt(var + eps) * weight + bias\n",
            loses={"test_sync_batch_norm_basic": "each rank normalised with its own shard's statistics",
                   "test_sync_batch_norm_uneven": "each rank normalised with its own shard's statistics"}),
        Bug("memory_per_gpu", "forgot_the_gradients",
            patch=[(GRADIENTS, '        "gradients": 0,\n')],
            loses={"test_memory_per_gpu_model_states": "'gradients' is 0 bytes (0 bytes per parameter), expected 3 GB",
                   "test_memory_per_gpu_data_parallel": "'gradients' is 0 bytes"}),
    ]),
    Variant("plain_average_of_unequal_shards", [
        Bug("shard_indices", "chunk_sizes_of_ceil",
            patch=[(SPREAD, "        size = -(-n // world_size)\n"
                            "        return torch.arange(min(rank * size, n), min((rank + 1) * size, n))\n")],
            loses={"test_shard_indices_basic": "rank 2: shard_indices(10, rank, 4) has shape (3,), expected (2,)",
                   "test_shard_indices_policies":
                   "shard_indices(10, rank, 4, 'spread') gives shard sizes [3, 3, 3, 1]"}),
        Bug("data_parallel_gradient", "plain_mean_of_shard_gradients",
            patch=[(WEIGHTED, "            t += g\n"),
                   ("    return total\n",
                    "    return [t / sum(len(s) > 0 for s in torch.tensor_split(x, world_size)) for t in total]\n")],
            loses={"test_data_parallel_gradient_uneven": "is this the plain mean of the shard means? With unequal "
                                                         "shards, weight shard k's gradient by n_k / B"},
            keeps=["test_data_parallel_gradient_basic"]),
        Bug("simulated_dp_step", "plain_mean_of_worker_gradients",
            patch=[(AVERAGE, "    average = [sum(g[i] for g in grads) / len(grads) for i in range(len(grads[0]))]\n")],
            loses={"test_simulated_dp_step_uneven": "3 workers on 10 samples after 2 steps, replica 0"},
            keeps=["test_simulated_dp_step_basic"]),
        Bug("allreduce_sgd_step", "plain_mean_over_ranks",
            patch=[(SCALE_AND_REDUCE, REDUCE_THEN_DIVIDE)],
            loses={"test_allreduce_sgd_step_uneven": "10 samples over 3 ranks, after 2 steps"},
            keeps=["test_allreduce_sgd_step_basic"]),
        Bug("sync_batch_norm", "averages_shard_variances",
            patch=[(STATS, "    stats = torch.cat([count, x64.sum(0), x64.var(0, unbiased=False) * len(x)])\n"),
                   (MEAN_VAR, "    mean = stats[1:1 + c] / stats[0]\n"
                              "    var = stats[1 + c:] / stats[0]\n")],
            loses={"test_sync_batch_norm_basic": "misses the spread between the shards' means",
                   "test_sync_batch_norm_uneven": "misses the spread between the shards' means"}),
        Bug("memory_per_gpu", "adam_without_a_master_copy",  # 2 + 2 + 8 = 12 bytes per parameter
            patch=[("    master_bytes = 4 if mixed_precision else 0  # the fp32 copy the optimizer updates\n",
                    "    master_bytes = 0\n")],
            loses={"test_memory_per_gpu_model_states":
                   "'optimizer' is 12 GB (8 bytes per parameter), expected 18 GB (12 bytes per parameter): fp32 master",
                   "test_memory_per_gpu_data_parallel": "'optimizer' is 8,000,000 bytes (8 bytes per parameter), "
                                                        "expected 12,000,000 bytes (12 bytes per parameter): fp32 "
                                                        "throughout: the master copy"}),
    ]),
    Variant("gradients_not_zeroed", [
        Bug("shard_indices", "pad_repeats_the_last_sample",
            patch=[(PAD, "        return torch.arange(rank * size, (rank + 1) * size).clamp(max=n - 1)\n")],
            loses={"test_shard_indices_policies": "rank 3: shard_indices(10, rank, 4, 'pad') is tensor([9, 9, 9]"},
            keeps=["test_shard_indices_basic"]),
        Bug("data_parallel_gradient", "shard_gradients_not_zeroed",
            patch=[(LOCAL_GRADIENT, BACKWARD)],
            loses={"test_data_parallel_gradient_basic": "it is what gradients accumulated in .grad across the "
                                                        "shards give: forgot zero_grad?"}),
        Bug("simulated_dp_step", "replica_gradients_not_zeroed",
            patch=[("            grads.append(torch.autograd.grad(loss_fn(replica(xs), ys), list(replica.parameters())))\n",
                    "            loss_fn(replica(xs), ys).backward()  # accumulates into .grad, never zeroed\n"
                    "            grads.append([p.grad for p in replica.parameters()])\n")],
            loses={"test_simulated_dp_step_basic": "4 workers after 2 steps, replica 0"}),
        Bug("allreduce_sgd_step", "rank_gradients_not_zeroed",
            patch=[(LOCAL_STEP, "    loss_fn(model(xs), ys).backward()  # accumulates into .grad, never zeroed\n"
                                "    grads = [w.grad.clone() for w in weights]\n")],
            loses={"test_allreduce_sgd_step_basic": "rank 0 after 2 steps"}),
        Bug("sync_batch_norm", "float32_statistics",
            patch=[("    x64 = x.double()\n", "    x64 = x\n"),
                   ("dtype=torch.float64, device=x.device", "device=x.device")],
            loses={"test_sync_batch_norm_uneven": "large mean (1000 + N(0, 1)): accumulate in float64"},
            keeps=["test_sync_batch_norm_basic"]),
        Bug("memory_per_gpu", "fp16_optimizer_state",  # the moments kept in the weights' precision
            patch=[(OPTIMIZER, '        "optimizer": (master_bytes + weight_bytes * moments[optimizer]) * n_params,\n')],
            loses={"test_memory_per_gpu_model_states":
                   "'optimizer' is 12 GB (8 bytes per parameter), expected 18 GB (12 bytes per parameter)",
                   "test_memory_per_gpu_data_parallel": "'optimizer' is 8,000,000 bytes (8 bytes per parameter), "
                                                        "expected 12,000,000 bytes"}),
    ]),
    Variant("empty_shards_and_forgotten_replicas", [
        Bug("shard_indices", "drop_from_the_front",
            patch=[(DROP, "        skip = n % world_size\n"
                          "        return torch.arange(skip + rank * size, skip + (rank + 1) * size)\n")],
            loses={"test_shard_indices_policies": "rank 0: shard_indices(10, rank, 4, 'drop') is tensor([2, 3]"},
            keeps=["test_shard_indices_basic"]),
        Bug("data_parallel_gradient", "zeroed_after_instead_of_before",
            patch=[(LOCAL_GRADIENT, BACKWARD),
                   (WEIGHTED, WEIGHTED + "        model.zero_grad()\n")],
            loses={"test_data_parallel_gradient_uneven": "arrives with stale .grad from an earlier step), the "
                                                         "gradient of weight"},
            keeps=["test_data_parallel_gradient_basic"]),
        Bug("simulated_dp_step", "only_replica_0_updated",
            patch=[("        for replica in replicas:\n", "        for replica in replicas[:1]:\n")],
            loses={"test_simulated_dp_step_basic": "replica 1's weight differs from replica 0's"}),
        Bug("allreduce_sgd_step", "empty_shard_skips_the_all_reduce",
            patch=[("    weights = list(model.parameters())\n",
                    "    if len(xs) == 0:\n"
                    "        return\n"
                    "    weights = list(model.parameters())\n")],
            loses={"test_allreduce_sgd_step_uneven": "waiting for rank 2, which had already returned"},
            keeps=["test_allreduce_sgd_step_basic"]),
        Bug("sync_batch_norm", "mean_of_shard_means",
            patch=[(STATS, "    one = torch.ones(1, dtype=torch.float64, device=x.device)\n"
                           "    stats = torch.cat([count, one, x64.mean(0), (x64 * x64).sum(0)])\n"),
                   (MEAN_VAR, "    mean = stats[2:2 + c] / stats[1]\n"
                              "    var = stats[2 + c:] / stats[0] - mean * mean\n")],
            loses={"test_sync_batch_norm_uneven": "it uses the plain mean of the shard means: with unequal shards"},
            keeps=["test_sync_batch_norm_basic"]),
        Bug("memory_per_gpu", "activations_of_the_global_batch",  # each rank holds its shard, not the batch
            patch=[(LARGEST, "    largest_shard = global_batch\n")],
            loses={"test_memory_per_gpu_data_parallel":
                   "'activations' is 256,000 bytes, expected 32,000 bytes: the fullest rank holds 32 of the 256 "
                   "samples (8x the expected value)"},
            keeps=["test_memory_per_gpu_model_states"]),
    ]),
    Variant("whole_batch_everywhere", [
        Bug("shard_indices", "strided_for_every_policy",  # a rewrite: one rule whatever the policy
            source="def shard_indices(n, rank, world_size, remainder=\"spread\"):\n"
                   "    return torch.arange(n)[rank::world_size]\n",
            loses={"test_shard_indices_basic": "rank 0: shard_indices(10, rank, 4) is tensor([0, 4, 8]"}),
        Bug("data_parallel_gradient", "gradient_of_the_whole_batch",
            patch=[("    shards = zip(torch.tensor_split(x, world_size), torch.tensor_split(y, world_size), strict=True)\n",
                    "    shards = [(x, y)]\n")],
            loses={"test_data_parallel_gradient_basic": "the loss was computed on batches of sizes [12]"}),
        Bug("simulated_dp_step", "each_replica_its_own_gradient",  # a rewrite: no averaging at all
            source="def simulated_dp_step(replicas, loss_fn, x, y, lr):\n"
                   "    k = len(replicas)\n"
                   "    for replica, xs, ys in zip(replicas, torch.tensor_split(x, k), torch.tensor_split(y, k)):\n"
                   "        grads = torch.autograd.grad(loss_fn(replica(xs), ys), list(replica.parameters()))\n"
                   "        with torch.no_grad():\n"
                   "            for p, g in zip(replica.parameters(), grads):\n"
                   "                p -= lr * g\n",
            loses={"test_simulated_dp_step_basic": "replica 1's weight differs from replica 0's"}),
        Bug("allreduce_sgd_step", "whole_batch_on_every_rank",
            patch=[("    xs, ys = torch.tensor_split(x, world)[rank], torch.tensor_split(y, world)[rank]\n",
                    "    xs, ys = x, y\n"),
                   (SCALE_AND_REDUCE, REDUCE_THEN_DIVIDE)],
            loses={"test_allreduce_sgd_step_basic": "the loss was computed on batches of sizes [12, 12]"}),
        Bug("sync_batch_norm", "unbiased_variance",
            patch=[("    var = stats[1 + c:] / stats[0] - mean * mean\n",
                    "    var = (stats[1 + c:] - stats[0] * mean * mean) / (stats[0] - 1)\n")],
            loses={"test_sync_batch_norm_basic": "its variance divides by B − 1"}),
        Bug("memory_per_gpu", "model_states_split_over_the_ranks",  # "DDP splits the model"
            patch=[(GRADIENTS, GRADIENTS.replace("n_params", "n_params / world_size")),
                   (OPTIMIZER, OPTIMIZER.replace("n_params", "n_params / world_size")),
                   ('        "weights": weight_bytes * n_params,\n',
                    '        "weights": weight_bytes * n_params / world_size,\n')],
            loses={"test_memory_per_gpu_data_parallel":
                   "'weights' is 250,000 bytes (0.25 bytes per parameter), expected 2,000,000 bytes (2 bytes per "
                   "parameter): every rank holds the whole model, whatever the world size (0.125x"},
            keeps=["test_memory_per_gpu_model_states"]),
    ]),
    Bug("memory_per_gpu", "floor_of_the_shard",  # B // N misses the fullest rank's extra sample
        patch=[(LARGEST, "    largest_shard = global_batch // world_size\n")],
        loses={"test_memory_per_gpu_data_parallel": "'activations' is 2,000 bytes, expected 3,000 bytes: the "
                                                    "fullest rank holds 3 of the 10 samples"},
        keeps=["test_memory_per_gpu_model_states"]),
    Bug("shard_indices", "float_indices",  # indices built from floats: right values, wrong dtype
        patch=[("        return torch.arange(start, start + base + (rank < extra))\n",
                "        return torch.arange(float(start), start + base + (rank < extra))\n")],
        loses={"test_shard_indices_basic": "rank 0: shard_indices(10, rank, 4) has dtype float32, expected int64"}),
]
