"""Generated data sets and small models for the notebooks: no download, the same numbers everywhere.

Used by notebooks 01-02 (line, regression and spiral data) and 05 (smooth regression data,
my_share), by the references and by the hidden checks.

Data-parallel training is exact arithmetic on batches, so the notebooks need
batches whose numbers anyone can reproduce: every generator here takes a seed
and uses its own `torch.Generator`, leaving the global random state alone.
The models are tiny on purpose: a whole notebook runs in seconds on a laptop
CPU, and a float64 copy of a model gives the reference the tests compare with.
"""

import math

import torch
import torch.distributed as dist
from torch import nn

from dpcourse.backend import rank_device
from dpcourse.toys.models import linear, mlp


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


def global_batch(X, Y, step, global_size):
    """The rows of global batch number `step`: rows step*global_size ... (step+1)*global_size - 1."""
    rows = slice(step * global_size, (step + 1) * global_size)
    return X[rows], Y[rows]


def my_share(X, Y, step, per_rank, rank=None, world_size=None, device=None):
    """This rank's share of global batch `step`: its `per_rank` consecutive rows, on rank_device().

    With 4 ranks and per_rank=32 (a global batch of 128), rank 2 takes rows 64..95 of the batch.
    """
    rank = dist.get_rank() if rank is None else rank
    world_size = dist.get_world_size() if world_size is None else world_size
    xb, yb = global_batch(X, Y, step, per_rank * world_size)
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    device = rank_device() if device is None else device
    return xb[rows].to(device), yb[rows].to(device)
