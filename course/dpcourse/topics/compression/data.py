"""Gradients whose sums are exact, and the one small task notebook 11 trains every method on.

Why exact: a top-k all-reduce adds the ranks' sparse contributions in some order -- the learner's,
gloo's, the grader's router's -- and a single-process simulation adds them in another. Floating-point
addition is not associative, so two correct programs could differ in the last bit. Not here: every
value is a multiple of 2**-scale below 2**bits, so every sum of a few of them is exact in the
tensor's dtype (float64: 2**-10 steps below 2**20, 30 bits of the 53; float32: 2**-4 steps below
2**10, 14 bits of the 24), whatever the order. Dividing by N = 2 or 4 is exact too. So a correct
top-k all-reduce equals the simulation bit for bit, and any difference is a bug.

Why one task: the notebook's picture puts every method (full all-reduce, top-k, PowerSGD, local SGD,
asynchronous SGD) on the same axes, so they must train the same model on the same data.
"""

import torch

from dpcourse.toys.data import smooth_regression_data

# dtype -> (bits of magnitude, bits below the point): values are integers in (-2**(bits+scale),
# 2**(bits+scale)) divided by 2**scale
EXACT = {torch.float64: (20, 10), torch.float32: (10, 4)}


def dyadic_tensor(numel, generator, dtype=torch.float64):
    """numel values, multiples of 2**-scale below 2**bits in magnitude (see EXACT)."""
    if dtype not in EXACT:
        raise ValueError(f"exact gradients exist for {sorted(map(str, EXACT))}, not {dtype}")
    bits, scale = EXACT[dtype]
    whole = torch.randint(-2 ** (bits + scale) + 1, 2 ** (bits + scale), (numel,), generator=generator)
    return whole.to(dtype) / 2 ** scale


def dyadic_gradients(world_size, steps, numel, seed=0, dtype=torch.float64):
    """grads[r][t]: rank r's gradient at step t, a 1-D tensor of `numel` exact values (see above)."""
    g = torch.Generator().manual_seed(seed)
    return [[dyadic_tensor(numel, g, dtype) for _ in range(steps)] for _ in range(world_size)]


def boundary_tie(tensor, k):
    """Whether the k-th and (k+1)-th largest magnitudes of `tensor` are equal: then 'the k largest'
    is ambiguous and two correct implementations may pick different entries (tests avoid it)."""
    flat = tensor.reshape(-1).abs()
    if k >= flat.numel():
        return False
    top = torch.topk(flat, k + 1).values
    return bool(top[k - 1] == top[k])


# The small task of every training run in notebook 11: a float64 MLP 8 -> 16 -> 16 -> 2 (fc0, fc1,
# head) on the smooth regression data of the DDP chapters.
TASK_MODEL = ("deep_mlp", {"depth": 2, "width": 16})


def task_data(steps, per_rank, world_size, seed=1):
    """(X, Y): `steps` global batches of per_rank x world_size rows, in order (toys.data.global_batch)."""
    return smooth_regression_data(steps * per_rank * world_size, seed=seed)


def task_with_held_out(steps, per_rank, world_size, seed=1, held=256):
    """(X, Y, X_held, Y_held): the training rows of `task_data`'s shape and `held` more rows of the same
    regression problem that no run trains on, to measure a model's loss in the demos' curves.

    One draw for both: smooth_regression_data draws its inputs before its target weights, so two calls
    with different row counts would not share the target function."""
    n = steps * per_rank * world_size
    X, Y = smooth_regression_data(n + held, seed=seed)
    return X[:n], Y[:n], X[n:], Y[n:]
