"""Planted bugs for 01_first_principles: each must lose the listed cells with a message saying why.

The five exercises are independent, so each variant plants one bug in every exercise
(five variants, five bugs per exercise) and lists every cell it must lose.
"""

# ---- exercise 1: shard_indices -------------------------------------------------------------
LAST_RANK_TAKES_REMAINDER = """
def shard_indices(n, rank, world_size, remainder="spread"):
    size = n // world_size
    if remainder == "drop":
        return torch.arange(rank * size, (rank + 1) * size)
    if remainder == "pad":
        size = -(-n // world_size)
        return torch.arange(rank * size, (rank + 1) * size) % n
    end = n if rank == world_size - 1 else (rank + 1) * size
    return torch.arange(rank * size, end)
"""

CHUNK_SIZES = """
def shard_indices(n, rank, world_size, remainder="spread"):
    if remainder == "drop":
        size = n // world_size
        return torch.arange(rank * size, (rank + 1) * size)
    size = -(-n // world_size)
    if remainder == "pad":
        return torch.arange(rank * size, (rank + 1) * size) % n
    return torch.arange(min(rank * size, n), min((rank + 1) * size, n))
"""

PAD_REPEATS_LAST_SAMPLE = """
def shard_indices(n, rank, world_size, remainder="spread"):
    if remainder == "spread":
        return torch.tensor_split(torch.arange(n), world_size)[rank]
    if remainder == "drop":
        size = n // world_size
        return torch.arange(rank * size, (rank + 1) * size)
    size = -(-n // world_size)
    return torch.arange(rank * size, (rank + 1) * size).clamp(max=n - 1)
"""

DROP_FROM_THE_FRONT = """
def shard_indices(n, rank, world_size, remainder="spread"):
    if remainder == "spread":
        return torch.tensor_split(torch.arange(n), world_size)[rank]
    if remainder == "drop":
        size, skip = n // world_size, n % world_size
        return torch.arange(skip + rank * size, skip + (rank + 1) * size)
    size = -(-n // world_size)
    return torch.arange(rank * size, (rank + 1) * size) % n
"""

STRIDED = """
def shard_indices(n, rank, world_size, remainder="spread"):
    return torch.arange(n)[rank::world_size]
"""

# ---- exercise 2: data_parallel_gradient ------------------------------------------------------
GRADIENT_SUM = """
def data_parallel_gradient(model, loss_fn, x, y, world_size):
    params = list(model.parameters())
    total = [torch.zeros_like(p) for p in params]
    for xs, ys in zip(torch.tensor_split(x, world_size), torch.tensor_split(y, world_size)):
        if len(xs):
            for t, g in zip(total, torch.autograd.grad(loss_fn(model(xs), ys), params)):
                t += g
    return total
"""

GRADIENT_PLAIN_MEAN = """
def data_parallel_gradient(model, loss_fn, x, y, world_size):
    params = list(model.parameters())
    grads = [torch.autograd.grad(loss_fn(model(xs), ys), params)
             for xs, ys in zip(torch.tensor_split(x, world_size), torch.tensor_split(y, world_size))
             if len(xs)]
    return [sum(g[i] for g in grads) / len(grads) for i in range(len(params))]
"""

GRADIENT_NOT_ZEROED = """
def data_parallel_gradient(model, loss_fn, x, y, world_size):
    params = list(model.parameters())
    total = [torch.zeros_like(p) for p in params]
    for xs, ys in zip(torch.tensor_split(x, world_size), torch.tensor_split(y, world_size)):
        if len(xs):
            loss_fn(model(xs), ys).backward()
            for t, p in zip(total, params):
                t += p.grad * (len(xs) / len(x))
    return total
"""

GRADIENT_ZEROED_AFTER_INSTEAD_OF_BEFORE = """
def data_parallel_gradient(model, loss_fn, x, y, world_size):
    params = list(model.parameters())
    total = [torch.zeros_like(p) for p in params]
    for xs, ys in zip(torch.tensor_split(x, world_size), torch.tensor_split(y, world_size)):
        if len(xs):
            loss_fn(model(xs), ys).backward()
            for t, p in zip(total, params):
                t += p.grad * (len(xs) / len(x))
            model.zero_grad()
    return total
"""

GRADIENT_OF_WHOLE_BATCH = """
def data_parallel_gradient(model, loss_fn, x, y, world_size):
    return list(torch.autograd.grad(loss_fn(model(x), y), list(model.parameters())))
"""

# ---- exercise 3: simulated_dp_step ------------------------------------------------------------
def simulated(combine, update="every replica"):
    """A simulated step whose only bugs are how it combines gradients and which replicas it updates."""
    replicas = "replicas" if update == "every replica" else "replicas[:1]"
    return f"""
def simulated_dp_step(replicas, loss_fn, x, y, lr):
    k = len(replicas)
    sizes, grads = [], []
    for replica, xs, ys in zip(replicas, torch.tensor_split(x, k), torch.tensor_split(y, k)):
        if len(xs):
            grads.append(torch.autograd.grad(loss_fn(replica(xs), ys), list(replica.parameters())))
            sizes.append(len(xs))
    average = [{combine} for i in range(len(grads[0]))]
    with torch.no_grad():
        for replica in {replicas}:
            for p, g in zip(replica.parameters(), average):
                p -= lr * g
"""


SIMULATED_NOT_ZEROED = """
def simulated_dp_step(replicas, loss_fn, x, y, lr):
    k = len(replicas)
    shards = list(zip(torch.tensor_split(x, k), torch.tensor_split(y, k)))
    for replica, (xs, ys) in zip(replicas, shards):
        loss_fn(replica(xs), ys).backward()
    average = [sum(r_params[i].grad * len(xs) for r_params, (xs, _) in
                   zip([list(r.parameters()) for r in replicas], shards)) / len(x)
               for i in range(len(list(replicas[0].parameters())))]
    with torch.no_grad():
        for replica in replicas:
            for p, g in zip(replica.parameters(), average):
                p -= lr * g
"""

SIMULATED_NO_AVERAGING = """
def simulated_dp_step(replicas, loss_fn, x, y, lr):
    k = len(replicas)
    for replica, xs, ys in zip(replicas, torch.tensor_split(x, k), torch.tensor_split(y, k)):
        grads = torch.autograd.grad(loss_fn(replica(xs), ys), list(replica.parameters()))
        with torch.no_grad():
            for p, g in zip(replica.parameters(), grads):
                p -= lr * g
"""

# ---- exercise 4: allreduce_sgd_step -------------------------------------------------------------
def allreduce_step(scale_before="len(xs) / len(x)", divide_after="1", shard="mine", zero=True,
                   empty="zeros"):
    """An all-reduce step with one knob per classic mistake."""
    take = ("torch.tensor_split(x, world)[rank], torch.tensor_split(y, world)[rank]"
            if shard == "mine" else "x, y")
    if empty == "return":
        skip = "    if len(xs) == 0:\n        return\n"
    else:
        skip = ""
    if zero:
        local = """    if len(xs):
        grads = torch.autograd.grad(loss_fn(model(xs), ys), params)
    else:
        grads = [torch.zeros_like(p) for p in params]
"""
    else:
        local = """    loss_fn(model(xs), ys).backward()
    grads = [p.grad.clone() for p in params]
"""
    return f"""
def allreduce_sgd_step(model, loss_fn, x, y, lr):
    rank, world = dist.get_rank(), dist.get_world_size()
    xs, ys = {take}
{skip}    params = list(model.parameters())
{local}    for p, g in zip(params, grads):
        g = g * ({scale_before})
        dist.all_reduce(g)
        g = g / ({divide_after})
        with torch.no_grad():
            p -= lr * g
"""


# ---- exercise 5: sync_batch_norm ---------------------------------------------------------------
SYNC_BN_LOCAL_ONLY = """
def sync_batch_norm(x, weight, bias, eps=1e-5):
    mean = x.mean(0)
    var = x.var(0, unbiased=False)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias
"""

SYNC_BN_AVERAGES_VARIANCES = """
def sync_batch_norm(x, weight, bias, eps=1e-5):
    c = x.shape[1]
    stats = torch.cat([torch.tensor([float(len(x))], dtype=torch.float64),
                       x.double().sum(0), x.double().var(0, unbiased=False) * len(x)])
    dist.all_reduce(stats)
    mean, var = stats[1:1 + c] / stats[0], stats[1 + c:] / stats[0]
    return ((x.double() - mean) / torch.sqrt(var + eps) * weight + bias).to(x.dtype)
"""

SYNC_BN_FLOAT32 = """
def sync_batch_norm(x, weight, bias, eps=1e-5):
    c = x.shape[1]
    stats = torch.cat([torch.tensor([float(len(x))]), x.sum(0), (x * x).sum(0)])
    dist.all_reduce(stats)
    mean = stats[1:1 + c] / stats[0]
    var = stats[1 + c:] / stats[0] - mean * mean
    return (x - mean) / torch.sqrt(var + eps) * weight + bias
"""

SYNC_BN_MEAN_OF_MEANS = """
def sync_batch_norm(x, weight, bias, eps=1e-5):
    c = x.shape[1]
    x64 = x.double()
    stats = torch.cat([torch.tensor([float(len(x)), 1.0], dtype=torch.float64), x64.mean(0),
                       (x64 * x64).sum(0)])
    dist.all_reduce(stats)
    mean = stats[2:2 + c] / stats[1]
    var = stats[2 + c:] / stats[0] - mean * mean
    return ((x64 - mean) / torch.sqrt(var + eps) * weight + bias).to(x.dtype)
"""

SYNC_BN_UNBIASED = """
def sync_batch_norm(x, weight, bias, eps=1e-5):
    c = x.shape[1]
    x64 = x.double()
    stats = torch.cat([torch.tensor([float(len(x))], dtype=torch.float64), x64.sum(0), (x64 * x64).sum(0)])
    dist.all_reduce(stats)
    n = stats[0]
    mean = stats[1:1 + c] / n
    var = (stats[1 + c:] - n * mean * mean) / (n - 1)
    return ((x64 - mean) / torch.sqrt(var + eps) * weight + bias).to(x.dtype)
"""

SUM = "sum(g[i] for g in grads)"
PLAIN_MEAN = "sum(g[i] for g in grads) / len(grads)"
WEIGHTED = "sum(s * g[i] for s, g in zip(sizes, grads)) / len(x)"

VARIANTS = {
    "sums_instead_of_averaging": {
        "cells": {"shard_indices": LAST_RANK_TAKES_REMAINDER,
                  "data_parallel_gradient": GRADIENT_SUM,
                  "simulated_dp_step": simulated(SUM),
                  "allreduce_sgd_step": allreduce_step(scale_before="1"),
                  "sync_batch_norm": SYNC_BN_LOCAL_ONLY},
        "loses": {"test_shard_indices_basic":
                  "rank 0: shard_indices(10, rank, 4) has shape (2,), expected (3,)",
                  "test_shard_indices_policies":
                  "rank 3: shard_indices(3, 3, 4) has shape (3,), expected (0,)",
                  "test_data_parallel_gradient_basic": "(4x the expected values)",
                  "test_data_parallel_gradient_uneven": "the gradient of 0.weight",
                  "test_simulated_dp_step_basic": "(the update is 3.41x the reference update)",
                  "test_simulated_dp_step_uneven": "replica 0",
                  "test_allreduce_sgd_step_basic": "rank 0 after 2 steps: weight",
                  "test_allreduce_sgd_step_uneven": "rank 0, 10 samples over 3 ranks",
                  "test_sync_batch_norm_basic": "rank 0: sync_batch_norm of 2 shards of 4 rows is",
                  "test_sync_batch_norm_uneven": "sync_batch_norm of shards of 5, 1 and 3 rows is"},
    },
    "plain_average_of_unequal_shards": {
        "cells": {"shard_indices": CHUNK_SIZES,
                  "data_parallel_gradient": GRADIENT_PLAIN_MEAN,
                  "simulated_dp_step": simulated(PLAIN_MEAN),
                  "allreduce_sgd_step": allreduce_step(scale_before="1", divide_after="world"),
                  "sync_batch_norm": SYNC_BN_AVERAGES_VARIANCES},
        "loses": {"test_shard_indices_basic":
                  "rank 2: shard_indices(10, rank, 4) has shape (3,), expected (2,)",
                  "test_shard_indices_policies":
                  "shard_indices(10, rank, 4, 'spread') gives shard sizes [3, 3, 3, 1]",
                  "test_data_parallel_gradient_uneven": "shards 3, 3, 2, 2), the gradient of",
                  "test_simulated_dp_step_uneven": "3 workers on 10 samples after 2 steps, replica 0",
                  "test_allreduce_sgd_step_uneven": "10 samples over 3 ranks, after 2 steps",
                  "test_sync_batch_norm_basic": "rank 0: sync_batch_norm of 2 shards of 4 rows is",
                  "test_sync_batch_norm_uneven": "sync_batch_norm of shards of 5, 1 and 3 rows"},
        "keeps": ["test_data_parallel_gradient_basic", "test_simulated_dp_step_basic",
                  "test_allreduce_sgd_step_basic"],
    },
    "gradients_not_zeroed": {
        "cells": {"shard_indices": PAD_REPEATS_LAST_SAMPLE,
                  "data_parallel_gradient": GRADIENT_NOT_ZEROED,
                  "simulated_dp_step": SIMULATED_NOT_ZEROED,
                  "allreduce_sgd_step": allreduce_step(zero=False),
                  "sync_batch_norm": SYNC_BN_FLOAT32},
        "loses": {"test_shard_indices_policies":
                  "rank 3: shard_indices(10, rank, 4, 'pad') is tensor([9, 9, 9]",
                  "test_data_parallel_gradient_basic": "12 samples over 4 workers, the gradient of weight",
                  "test_simulated_dp_step_basic": "4 workers after 2 steps, replica 0",
                  "test_allreduce_sgd_step_basic": "rank 0 after 2 steps",
                  "test_sync_batch_norm_uneven": "large mean (1000 + N(0, 1)): accumulate in float64"},
        "keeps": ["test_shard_indices_basic", "test_sync_batch_norm_basic"],
    },
    "empty_shards_and_forgotten_replicas": {
        "cells": {"shard_indices": DROP_FROM_THE_FRONT,
                  "data_parallel_gradient": GRADIENT_ZEROED_AFTER_INSTEAD_OF_BEFORE,
                  "simulated_dp_step": simulated(WEIGHTED, update="replica 0 only"),
                  "allreduce_sgd_step": allreduce_step(empty="return"),
                  "sync_batch_norm": SYNC_BN_MEAN_OF_MEANS},
        "loses": {"test_shard_indices_policies":
                  "rank 0: shard_indices(10, rank, 4, 'drop') is tensor([2, 3]",
                  "test_data_parallel_gradient_uneven": "arrives with stale .grad",
                  "test_simulated_dp_step_basic": "replica 1's weight differs from replica 0's",
                  "test_allreduce_sgd_step_uneven": "waiting for rank 2, which had already returned",
                  "test_sync_batch_norm_uneven": "sync_batch_norm of shards of 5, 1 and 3 rows is"},
        "keeps": ["test_shard_indices_basic", "test_data_parallel_gradient_basic",
                  "test_allreduce_sgd_step_basic",
                  "test_sync_batch_norm_basic"],
    },
    "whole_batch_everywhere": {
        "cells": {"shard_indices": STRIDED,
                  "data_parallel_gradient": GRADIENT_OF_WHOLE_BATCH,
                  "simulated_dp_step": SIMULATED_NO_AVERAGING,
                  "allreduce_sgd_step": allreduce_step(shard="whole batch", scale_before="1",
                                                       divide_after="world"),
                  "sync_batch_norm": SYNC_BN_UNBIASED},
        "loses": {"test_shard_indices_basic": "rank 0: shard_indices(10, rank, 4) is tensor([0, 4, 8]",
                  "test_data_parallel_gradient_basic": "the loss was computed on batches of sizes [12]",
                  "test_simulated_dp_step_basic": "replica 1's weight differs from replica 0's",
                  "test_allreduce_sgd_step_basic": "the loss was computed on batches of sizes [12, 12]",
                  "test_sync_batch_norm_basic": "rank 0: sync_batch_norm of 2 shards of 4 rows is"},
    },
}
