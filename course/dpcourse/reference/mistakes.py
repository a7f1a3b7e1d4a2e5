"""Known wrong answers, computed independently in float64: what a result looks like with a classic bug.

    suspects = gradient_mistakes(model, loss_fn, x, y, world_size)
    expect_gradients(got, expected, names, what, suspects=suspects)   # "...: is this the plain mean
                                                                       #  of the shard means? ..."
Used by notebook 01 (the test cells of data_parallel_gradient and sync_batch_norm, and their
hidden checks in dpgrader.first_principles.checks), through dpcourse.checks.core.known_mistake.

Why: a wrong gradient printed next to the right one says that something is wrong, not what.
Data-parallel bugs have signatures -- the plain mean of unequal shards, a sum instead of a
weighted average, gradients accumulated in .grad, statistics of one shard -- and each can be
computed here exactly, from the shards, the way the bug would compute it. A result that
matches one gets that bug's sentence. Each dict maps a hint (the learner's words) to the wrong
answer, shaped like the right one; entries are omitted where the wrong answer equals the right one.
"""

import torch

from dpcourse.reference.gradients import batch_norm, full_batch_gradient

PLAIN_MEAN = ("it is the plain mean of the shard gradients: is this the plain mean of the shard means? With "
              "unequal shards, weight shard k's gradient by n_k / B")
SUM = ("it is the sum of the shard gradients: each shard's loss is already a mean, so weight shard k by "
       "n_k / B instead of adding")
NOT_ZEROED = ("it is what gradients accumulated in .grad across the shards give: forgot zero_grad? "
              "(.backward() adds to .grad; torch.autograd.grad leaves it alone)")
STALE = ("it includes the stale .grad the model arrived with: forgot zero_grad before the first shard? "
         "(or use torch.autograd.grad, which never reads .grad)")

LOCAL_STATISTICS = ("each rank normalised with its own shard's statistics: all-reduce the count, Σx and Σx² "
                    "and normalise with the global mean and variance")
MEAN_OF_MEANS = ("it uses the plain mean of the shard means: with unequal shards, all-reduce sums and "
                 "counts, not means")
AVERAGED_VARIANCES = ("its variance is the average of the shards' variances, which misses the spread between "
                      "the shards' means: all-reduce Σx² and use Σx²/B − μ²")
UNBIASED = "its variance divides by B − 1: BatchNorm normalises with the biased variance (divide by B)"


def _differs(wrong, right):
    return any(not torch.allclose(w, r, atol=1e-12, rtol=1e-9) for w, r in zip(wrong, right, strict=True))


def gradient_mistakes(model, loss_fn, x, y, world_size, stale=None):
    """{hint: wrong gradients} for the full-batch gradient computed over world_size shards
    (torch.tensor_split). stale: the .grad tensors the model arrives with, if any."""
    split = zip(torch.tensor_split(x, world_size), torch.tensor_split(y, world_size), strict=True)
    shards = [(len(xs), full_batch_gradient(model, loss_fn, xs, ys)) for xs, ys in split if len(xs)]
    batch, count = len(x), len(shards)
    right = [sum(n / batch * g[i] for n, g in shards) for i in range(len(shards[0][1]))]
    wrong = {PLAIN_MEAN: [sum(g[i] for _, g in shards) / count for i in range(len(right))],
             SUM: [sum(g[i] for _, g in shards) for i in range(len(right))]}
    running = [s.double() for s in stale] if stale is not None else [torch.zeros_like(r) for r in right]
    accumulated = [torch.zeros_like(r) for r in right]
    for n, g in shards:  # .grad after each shard's backward, never zeroed, weighted n_k / B
        running = [r + gi for r, gi in zip(running, g, strict=True)]
        accumulated = [a + n / batch * r for a, r in zip(accumulated, running, strict=True)]
    wrong[NOT_ZEROED] = accumulated
    if stale is not None:
        first = shards[0][0] / batch
        wrong[STALE] = [r + first * s.double() for r, s in zip(right, stale, strict=True)]
    return {hint: w for hint, w in wrong.items() if _differs(w, right)}


def batch_norm_mistakes(shards, weight, bias, eps=1e-5):
    """{hint: one wrong output per rank} for batch normalisation of the shards' rows together."""
    xs = [s.cpu().double() for s in shards]
    whole = torch.cat(xs)
    w, b = weight.cpu().double(), bias.cpu().double()

    def normalise(mean, var):
        return [(x - mean) / torch.sqrt(var + eps) * w + b for x in xs]

    mean, batch = whole.mean(0), len(whole)
    filled = [x for x in xs if len(x)]
    mean_of_means = sum(x.mean(0) for x in filled) / len(filled)
    within = sum(x.var(0, unbiased=False) * len(x) for x in filled) / batch
    wrong = {
        LOCAL_STATISTICS: [batch_norm(x, weight, bias, eps) if len(x) else x.clone() for x in xs],
        MEAN_OF_MEANS: normalise(mean_of_means, (whole * whole).mean(0) - mean_of_means ** 2),
        AVERAGED_VARIANCES: normalise(mean, within),
        UNBIASED: normalise(mean, whole.var(0, unbiased=True)) if batch > 1 else normalise(mean, mean * 0),
    }
    right = batch_norm(whole, weight, bias, eps).split([len(x) for x in xs])
    return {hint: out for hint, out in wrong.items() if _differs(out, right)}
