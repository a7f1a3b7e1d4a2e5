"""dpcourse.reference.mistakes: each classic bug, written out here, is recognised by its own hint."""

import torch
from torch import nn

from dpcourse.checks.core import known_mistake
from dpcourse.reference import mistakes
from dpcourse.reference.gradients import batch_norm, full_batch_gradient
from dpcourse.toys.data import spiral_data
from dpcourse.toys.models import mlp
from markers import exercise


def shard_grads(model, loss_fn, x, y, world):
    pairs = zip(torch.tensor_split(x, world), torch.tensor_split(y, world), strict=True)
    params = list(model.parameters())
    return [(len(xs), torch.autograd.grad(loss_fn(model(xs), ys), params)) for xs, ys in pairs]


@exercise("data_parallel_gradient")
def test_gradient_bugs_are_named():
    model, (x, y), loss_fn = mlp(2, 8, 3, seed=2), spiral_data(10, seed=2), nn.CrossEntropyLoss()
    suspects = mistakes.gradient_mistakes(model, loss_fn, x, y, 4)
    shards = shard_grads(model, loss_fn, x, y, 4)
    plain = [sum(g[i] for _, g in shards) / 4 for i in range(len(shards[0][1]))]
    summed = [sum(g[i] for _, g in shards) for i in range(len(shards[0][1]))]
    assert known_mistake(plain, suspects) == mistakes.PLAIN_MEAN
    assert known_mistake(summed, suspects) == mistakes.SUM
    model.zero_grad(set_to_none=True)
    total = [torch.zeros_like(p) for p in model.parameters()]
    for xs, ys in zip(torch.tensor_split(x, 4), torch.tensor_split(y, 4), strict=True):
        loss_fn(model(xs), ys).backward()  # never zeroed
        total = [t + p.grad * (len(xs) / len(x)) for t, p in zip(total, model.parameters(), strict=True)]
    assert known_mistake(total, suspects) == mistakes.NOT_ZEROED
    right = full_batch_gradient(model, loss_fn, x, y)
    assert known_mistake([r.float() for r in right], suspects) == ""


@exercise("data_parallel_gradient")
def test_stale_gradients_are_named():
    model, (x, y), loss_fn = mlp(2, 8, 3, seed=3), spiral_data(9, seed=3), nn.CrossEntropyLoss()
    stale = [torch.full_like(p, 7.0) for p in model.parameters()]
    suspects = mistakes.gradient_mistakes(model, loss_fn, x, y, 3, stale=stale)
    right = full_batch_gradient(model, loss_fn, x, y)
    zeroed_after = [r + 3 / 9 * s for r, s in zip(right, stale, strict=True)]  # zero_grad after each shard
    assert known_mistake(zeroed_after, suspects) == mistakes.STALE


@exercise("sync_batch_norm")
def test_batch_norm_bugs_are_named():
    g = torch.Generator().manual_seed(1)
    shards = [torch.randn(n, 2, generator=g) * 2 + n for n in (5, 1, 3)]
    weight, bias = torch.ones(2), torch.zeros(2)
    suspects = mistakes.batch_norm_mistakes(shards, weight, bias)
    local = [(s - s.mean(0)) / torch.sqrt(s.var(0, unbiased=False) + 1e-5) for s in shards]  # alone
    assert known_mistake(local, suspects) == mistakes.LOCAL_STATISTICS
    whole = torch.cat(shards).double()
    mean = whole.mean(0)
    for hint, var in [(mistakes.AVERAGED_VARIANCES, sum(s.double().var(0, unbiased=False) * len(s)
                                                        for s in shards) / len(whole)),
                      (mistakes.UNBIASED, whole.var(0))]:
        out = [((s - mean) / torch.sqrt(var + 1e-5)).float() for s in shards]
        assert known_mistake(out, suspects) == hint
    means = sum(s.double().mean(0) for s in shards) / 3
    out = [((s - means) / torch.sqrt((whole * whole).mean(0) - means ** 2 + 1e-5)).float() for s in shards]
    assert known_mistake(out, suspects) == mistakes.MEAN_OF_MEANS
    right = batch_norm(torch.cat(shards), weight, bias).split([5, 1, 3])
    assert known_mistake(list(right), suspects) == ""
