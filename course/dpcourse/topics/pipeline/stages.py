"""A model split into pipeline stages: which layers a rank runs, and who its neighbours are.

    model = layer_stack([8, 16, 16, 2], seed=0)   # Linear, Tanh, Linear, Tanh, Linear: 5 layers
    cuts = [0, 2, 5]                               # stage s runs layers cuts[s] .. cuts[s + 1] - 1
    split_model(model, cuts)                       # [model[0:2], model[2:5]]: names kept ("2.weight")
    stage = make_stage(model, cuts, index=1)       # what rank 1 needs to run stage 1
    stage.module, stage.prev, stage.next, stage.in_features, stage.out_features

Why a Stage object: a rank of a pipeline needs more than its layers. It needs the ranks
of its neighbours (not s - 1 and s + 1 once a pipeline lives inside a bigger job, as in
notebook 09's data x pipeline grid), and the width of the activation it receives (to
allocate the buffer a `recv` writes into) and of the one it sends (to allocate the
gradient that comes back). Slicing an nn.Sequential keeps the layers' names, so stage s's
gradient of "2.weight" can be compared with the whole model's "2.weight".

`SlowLinear` is a Linear layer that also sleeps a fixed time in forward and in backward:
it stands in for a big layer in timelines, and sleeping needs no core, so four stages on
a two-core laptop behave as if each had its own device.

Used by notebooks 07 (pipeline parallelism) and 09 (hybrid parallelism).
"""

import time
from dataclasses import dataclass
from itertools import pairwise

import torch
from torch import nn


@dataclass
class Stage:
    """What one rank of a pipeline runs, and whom it talks to.

    module: the stage's layers (an nn.Sequential slice of the whole model);
    index: s, from 0 (takes the batch) to n_stages - 1 (computes the loss);
    ranks: the world rank of every stage, in stage order (range(n_stages) by default);
    in_features / out_features: the width of the activation this stage receives / sends.
    """

    module: nn.Module
    index: int
    n_stages: int
    ranks: tuple
    in_features: int
    out_features: int
    dtype: torch.dtype
    device: torch.device

    @property
    def is_first(self):
        return self.index == 0

    @property
    def is_last(self):
        return self.index == self.n_stages - 1

    @property
    def rank(self):
        """The world rank this stage runs on."""
        return self.ranks[self.index]

    @property
    def prev(self):
        """The world rank of the previous stage (None on the first stage)."""
        return None if self.is_first else self.ranks[self.index - 1]

    @property
    def next(self):
        """The world rank of the next stage (None on the last stage)."""
        return None if self.is_last else self.ranks[self.index + 1]

    def __repr__(self):
        return (f"Stage({self.index} of {self.n_stages}, rank {self.rank}, prev={self.prev}, "
                f"next={self.next}, in_features={self.in_features}, out_features={self.out_features}, "
                f"layers {list(self.module._modules)})")


def check_cuts(cuts, n_layers):
    """Raise a ValueError unless cuts = [0, ..., n_layers], strictly increasing (no empty stage)."""
    cuts = list(cuts)
    if len(cuts) < 2 or cuts[0] != 0 or cuts[-1] != n_layers:
        raise ValueError(f"cuts {cuts} must start at 0 and end at the number of layers, {n_layers}")
    if any(b <= a for a, b in pairwise(cuts)):
        raise ValueError(f"cuts {cuts} must be strictly increasing: every stage runs at least one layer")
    return cuts


def split_model(model, cuts):
    """The stage modules of an nn.Sequential cut at `cuts`: [model[cuts[0]:cuts[1]], ...]."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"split_model splits an nn.Sequential, got {type(model).__name__}")
    cuts = check_cuts(cuts, len(model))
    return [model[a:b] for a, b in pairwise(cuts)]


def boundary_widths(model):
    """widths[i]: the feature width of the activation entering layer i (widths[-1]: the output).

    Found by running one row of zeros through the layers, so any layer that keeps a
    (rows, features) shape works.
    """
    first = next((m for m in model.modules() if isinstance(m, nn.Linear)), None)
    if first is None:
        raise ValueError("boundary_widths needs a model with at least one nn.Linear")
    p = next(model.parameters())
    x = torch.zeros(1, first.in_features, dtype=p.dtype, device=p.device)
    widths = [x.shape[1]]
    with torch.no_grad():
        for layer in model:
            x = layer(x)
            widths.append(x.shape[1])
    return widths


def make_stage(model, cuts, index, ranks=None, device=None):
    """The Stage that runs layers cuts[index] .. cuts[index + 1] - 1 of `model` (moved to `device`)."""
    modules = split_model(model, cuts)
    n_stages = len(modules)
    ranks = tuple(range(n_stages) if ranks is None else ranks)
    if len(ranks) != n_stages or len(set(ranks)) != n_stages:
        raise ValueError(f"ranks {list(ranks)} must name {n_stages} different ranks, one per stage")
    if not 0 <= index < n_stages:
        raise ValueError(f"stage index {index} is not one of the {n_stages} stages")
    widths = boundary_widths(model)
    p = next(model.parameters())
    device = torch.device(device) if device is not None else p.device
    return Stage(modules[index].to(device), index, n_stages, ranks, widths[cuts[index]],
                 widths[cuts[index + 1]], p.dtype, device)


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class SlowLinear(nn.Linear):
    """nn.Linear that sleeps `forward_ms` in forward and `backward_ms` in backward: a big layer's stand-in."""

    def __init__(self, in_features, out_features, forward_ms=0.0, backward_ms=0.0):
        super().__init__(in_features, out_features)
        self.forward_ms, self.backward_ms = forward_ms, backward_ms

    def forward(self, x):
        return _Sleep.apply(super().forward(x), self.forward_ms / 1e3, self.backward_ms / 1e3)

    def extra_repr(self):
        return (f"{super().extra_repr()}, sleeps {self.forward_ms:g} ms forward, "
                f"{self.backward_ms:g} ms backward")


def layer_stack(widths, seed=0, dtype=torch.float64, device=None, forward_ms=0.0, backward_ms=0.0):
    """Linear(widths[0], widths[1]), Tanh, Linear(widths[1], widths[2]), Tanh, ..., Linear(.., widths[-1]).

    One nn.Sequential whose layers are numbered 0, 1, 2, ...: 2 * (len(widths) - 1) - 1 layers,
    the Tanh ones without parameters. The same seed gives the same parameters in every process.
    forward_ms / backward_ms > 0 make every Linear a SlowLinear that sleeps that long.
    """
    if len(widths) < 2:
        raise ValueError(f"layer_stack needs at least an input and an output width, got {widths}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers = []
        for i, (a, b) in enumerate(pairwise(widths)):
            if i:
                layers.append(nn.Tanh())
            slow = forward_ms or backward_ms
            layers.append(SlowLinear(a, b, forward_ms, backward_ms) if slow else nn.Linear(a, b))
        model = nn.Sequential(*layers)
    return model.to(dtype=dtype, device=device if device is not None else "cpu")
