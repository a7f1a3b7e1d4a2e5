"""The models notebook 09 trains on a grid: unsharded (one process) and split over a tensor-parallel group.

    full = dp_tp_model(d_in=6, d_model=8, d_hidden=16, d_out=3, blocks=2, seed=0)
    local = tensor_parallel_copy(full, mesh["tp"])     # inside a rank: this rank's slices
    placement("1.block.fc1.weight")                    # "column": how the parameter is split over tp

    full = dp_pp_model(width=6, layers=4, seed=0)      # Linear, Tanh, Linear, ...: cut into stages

Why these models: a data x tensor parallel step must decide, parameter by parameter, which
group its gradient is averaged over, so the model has both kinds of parameter a
tensor-parallel transformer has: slices (the MLP's fc1 by rows, fc2 by columns: each tp rank
holds a different piece) and replicated ones (the input and output layers and fc2's bias,
which every tp rank holds whole and computes the same gradient for). Each block is a residual
MLP, x + MLP(x), as in a transformer layer, so the input of every block needs a gradient and
f's all-reduce runs in backward. The pipeline model is notebook 07's `layer_stack` with equal
widths, so every stage's parameters have the same shapes (an all-reduce over the wrong group
then gives wrong numbers, not a crash). All float64, built from a seed: every rank and every
test cell rebuild the same weights. Used by notebook 09.
"""

import torch
from torch import nn

from dpcourse.topics.pipeline.stages import layer_stack
from dpcourse.topics.tensor.layers import TensorParallelMLP
from dpcourse.topics.tensor.models import MLP


class Residual(nn.Module):
    """x + block(x): a transformer layer's residual connection around one block."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return x + self.block(x)


def dp_tp_model(d_in=6, d_model=8, d_hidden=16, d_out=3, blocks=1, bias=True, seed=0, dtype=torch.float64):
    """Linear(d_in, d_model), `blocks` residual MLPs (d_model -> d_hidden -> d_model), Linear(d_model,
    d_out)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers = [nn.Linear(d_in, d_model, bias=bias)]
        layers += [Residual(MLP(d_model, d_hidden, bias=bias)) for _ in range(blocks)]
        layers.append(nn.Linear(d_model, d_out, bias=bias))
        model = nn.Sequential(*layers)
    return model.to(dtype=dtype)


def tensor_parallel_copy(full, tp_mesh, make_block=None):
    """Inside a rank: the same model with every residual MLP tensor-parallel over `tp_mesh`
    (dpcourse.topics.tensor.layers); the first and last Linear stay whole (replicated). The
    parameters keep the full model's names, each holding this rank's slice.

    make_block: optional `make_block(mlp)` building the tensor-parallel MLP another way (a
    learner's own layers from notebook 08), with the attribute names fc1, act, fc2."""
    make_block = make_block or (lambda mlp: TensorParallelMLP(mlp, tp_mesh))
    layers = []
    for layer in full:
        if isinstance(layer, Residual):
            layers.append(Residual(make_block(layer.block)))
        else:
            copy = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
            copy.load_state_dict(layer.state_dict())
            layers.append(copy.to(dtype=layer.weight.dtype))
    return nn.Sequential(*layers)


def placement(name):
    """How a parameter of the tensor-parallel copy is split over tp: "column" (rows of W, or the
    bias with them), "row" (columns of W) or "replicated" (whole on every tp rank)."""
    if ".block.fc1." in name:
        return "column"
    if name.endswith(".block.fc2.weight"):
        return "row"
    return "replicated"


def dp_pp_model(width=6, layers=4, seed=0, dtype=torch.float64):
    """`layers` Linear(width, width) with a Tanh between each two: 2 * layers - 1 modules."""
    return layer_stack([width] * (layers + 1), seed=seed, dtype=dtype)


def even_cuts(n_modules, n_stages):
    """Cuts of a dp_pp_model into stages of whole (Linear, Tanh) pairs: [0, 2k, 4k, ..., n_modules]."""
    linears = (n_modules + 1) // 2
    if linears % n_stages:
        raise ValueError(f"{linears} Linear layers cannot be split evenly over {n_stages} stages")
    per = linears // n_stages
    return [min(2 * per * s, n_modules) for s in range(n_stages)] + [n_modules]
