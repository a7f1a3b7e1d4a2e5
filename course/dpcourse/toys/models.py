"""Small seeded models: MLPs, a linear layer, and the DDP chapters' models with tricky parameters.

Used by notebooks 01-02 (mlp, linear, RecordingLoss) and 05 (deep_mlp and the MODELS of the DDP
checks: buffers, a frozen layer, tied layers, an unused head), by the references and by the hidden
checks.

Every model is built from a seed without touching the global random state, so every rank (and the
reference) builds exactly the same one. The DDP chapters' models are float64 by default: averaging
N shard means and taking one mean over the global batch add numbers in different orders, ~1e-7
apart in float32 and growing with steps, ~1e-15 in float64, so a tolerance of 1e-9 separates
"right" from "wrong by a factor of N" with no doubt.
"""

from collections import OrderedDict

import torch
from torch import nn


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


def _seeded(build, seed, dtype, device):
    """Build a module with torch's default init drawn from `seed`, without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = build()
    return module.to(dtype=dtype, device=device if device is not None else "cpu")


def deep_mlp(depth=4, width=16, d_in=8, d_out=2, seed=0, dtype=torch.float64, device=None):
    """An MLP of `depth` hidden Linear+Tanh layers, named fc0, fc1, ..., head (deep = many buckets).

    The same seed gives the same initial parameters in every process, on every device.
    """
    def build():
        layers, width_in = OrderedDict(), d_in
        for i in range(depth):
            layers[f"fc{i}"] = nn.Linear(width_in, width)
            layers[f"act{i}"] = nn.Tanh()
            width_in = width
        layers["head"] = nn.Linear(width_in, d_out)
        return nn.Sequential(layers)
    return _seeded(build, seed, dtype, device)


def mlp_with_batchnorm(width=16, d_in=8, d_out=2, seed=0, dtype=torch.float64, device=None):
    """An MLP with a BatchNorm1d: it has buffers (running_mean, running_var, num_batches_tracked)."""
    def build():
        return nn.Sequential(OrderedDict(fc0=nn.Linear(d_in, width), bn=nn.BatchNorm1d(width),
                                         act=nn.Tanh(), head=nn.Linear(width, d_out)))
    return _seeded(build, seed, dtype, device)


class FrozenFirstLayer(nn.Module):
    """An MLP whose first layer is frozen (requires_grad=False): its parameters never get a gradient."""

    def __init__(self, width=16, d_in=8, d_out=2):
        super().__init__()
        self.frozen = nn.Linear(d_in, width).requires_grad_(False)
        self.fc = nn.Linear(width, width)
        self.head = nn.Linear(width, d_out)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(torch.tanh(self.frozen(x)))))


class TiedLayers(nn.Module):
    """An MLP that applies the same hidden layer twice: one parameter, two contributions to its gradient."""

    def __init__(self, width=16, d_in=8, d_out=2):
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.shared = nn.Linear(width, width)
        self.head = nn.Linear(width, d_out)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h))
        return self.head(h)


class UnusedHead(nn.Module):
    """An MLP with a second head that forward never calls: its parameters get no gradient."""

    def __init__(self, width=16, d_in=8, d_out=2):
        super().__init__()
        self.fc = nn.Linear(d_in, width)
        self.head = nn.Linear(width, d_out)
        self.unused_head = nn.Linear(width, d_out)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(x)))


def frozen_first_layer(seed=0, dtype=torch.float64, device=None):
    return _seeded(FrozenFirstLayer, seed, dtype, device)


def tied_layers(seed=0, dtype=torch.float64, device=None):
    return _seeded(TiedLayers, seed, dtype, device)


def unused_head(seed=0, dtype=torch.float64, device=None):
    return _seeded(UnusedHead, seed, dtype, device)


MODELS = {"deep_mlp": deep_mlp, "mlp_with_batchnorm": mlp_with_batchnorm,
          "frozen_first_layer": frozen_first_layer, "tied_layers": tied_layers,
          "unused_head": unused_head}


def loss_fn(output, target):
    """Mean squared error, averaged over the batch: the mean that DDP's gradient averaging reproduces."""
    return ((output - target) ** 2).mean()
