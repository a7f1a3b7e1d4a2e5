"""Generated data sets and small models for the notebooks: no download, the same numbers everywhere.

Data-parallel training is exact arithmetic on batches, so the notebooks need
batches whose numbers anyone can reproduce: every generator here takes a seed
and uses its own `torch.Generator`, leaving the global random state alone.
The models are tiny on purpose: a whole notebook runs in seconds on a laptop
CPU, and a float64 copy of a model gives the reference the tests compare with.
"""

import math

import torch
from torch import nn


def _generator(seed):
    return torch.Generator().manual_seed(seed)


def line_data(n=32, seed=0, slope=2.0, intercept=-1.0, noise=0.3):
    """n points on a noisy line y = slope * x + intercept, x in [-1, 1]: shapes (n, 1) and (n, 1).

    One input and two parameters (w, b): every gradient is a 2-D arrow you can draw.
    """
    g = _generator(seed)
    x = torch.rand(n, 1, generator=g) * 2 - 1
    y = slope * x + intercept + noise * torch.randn(n, 1, generator=g)
    return x, y


def regression_data(n=64, features=4, outputs=1, seed=0, noise=0.1, dtype=torch.float32, squash=False):
    """A noisy regression problem: x (n, features), y (n, outputs), the same for every caller.

    y = x @ w + noise, or with squash=True y = tanh(2 x @ w / sqrt(features)) + noise: a smooth
    non-linear target that a deep MLP has something to learn from (the DDP chapters use it).
    """
    g = _generator(seed)
    x = torch.randn(n, features, generator=g, dtype=dtype)
    w = torch.randn(features, outputs, generator=g, dtype=dtype)
    if squash:
        y = torch.tanh(x @ (w / features ** 0.5) * 2)
    else:
        y = x @ w
    return x, y + noise * torch.randn(n, outputs, generator=g, dtype=dtype)


def smooth_regression_data(n, features=8, outputs=2, seed=0, dtype=torch.float64):
    """The DDP chapters' data: `regression_data` with a squashed target, in float64 by default."""
    return regression_data(n, features, outputs, seed, noise=0.1, dtype=dtype, squash=True)


def spiral_data(n=512, classes=3, seed=0, noise=0.15):
    """Interleaved 2-D spirals, one per class: x (n, 2) float, y (n,) long. Not linearly separable,
    so a small MLP has something to learn for a few hundred steps."""
    g = _generator(seed)
    y = torch.arange(n) % classes
    t = torch.rand(n, generator=g) * 0.9 + 0.1
    angle = 3.0 * t + y * (2 * math.pi / classes) + noise * torch.randn(n, generator=g)
    x = torch.stack([t * torch.cos(angle), t * torch.sin(angle)], dim=1)
    return x * 2, y


def mlp(inputs=4, hidden=16, outputs=1, seed=0, batchnorm=False, dropout=0.0):
    """Linear -> [BatchNorm1d] -> ReLU -> [Dropout] -> Linear, initialised from `seed`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers = [nn.Linear(inputs, hidden)]
        if batchnorm:
            layers.append(nn.BatchNorm1d(hidden))
        layers.append(nn.ReLU())
        if dropout:
            layers.append(nn.Dropout(dropout))
        layers.append(nn.Linear(hidden, outputs))
        return nn.Sequential(*layers)


def linear(inputs=1, outputs=1, seed=0):
    """A single nn.Linear, initialised from `seed`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Linear(inputs, outputs)


def gradient_problems(seed=0):
    """A few (name, model, loss_fn, x, y) problems without BatchNorm or dropout, whose full-batch
    gradient of the mean loss is exactly the size-weighted average of shard gradients."""
    x1, y1 = line_data(10, seed=seed)
    x2, y2 = regression_data(13, features=4, outputs=2, seed=seed + 1)
    x3, y3 = spiral_data(11, classes=3, seed=seed + 2)
    return [
        ("a line fit (Linear 1->1, MSE)", linear(1, 1, seed), nn.MSELoss(), x1, y1),
        ("an MLP regression (4->16->2, MSE)", mlp(4, 16, 2, seed + 1), nn.MSELoss(), x2, y2),
        ("an MLP classifier (2->16->3, cross-entropy)", mlp(2, 16, 3, seed + 2), nn.CrossEntropyLoss(),
         x3, y3),
    ]


class RecordingLoss(nn.Module):
    """A loss function that remembers the batch size of every call (`sizes`).

    Tests use it to see *how* a function computed its result: on shards of the
    right sizes, or on the whole batch at once.
    """

    def __init__(self, loss_fn):
        super().__init__()
        self.loss_fn = loss_fn
        self.sizes = []

    def forward(self, output, target):
        self.sizes.append(len(output))
        return self.loss_fn(output, target)
