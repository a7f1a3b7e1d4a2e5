"""Which slice of each weight lives on which rank, read off a learner's own module and coloured by rank.

    held = launch(local_parameters_of, 4, TensorParallelMLP, ("mlp", dict(d_model=8, d_hidden=16, seed=0)))
    plot_weight_slices(full_parameters(("mlp", ...)), held, MLP_LAYOUT)

Why from the learner's module: the picture is not the textbook's; each rank's parameters are
looked up, by value, in the full weights (`shards.locate_slices`), and every element is painted
in the colours of the ranks that really hold it. A replicated bias is striped with every rank's
colour; a rank whose parameter is not a set of whole slices of the full one (transposed, scaled,
mixed up) is named in the title, and elements nobody holds stay white. Used by notebook 08.
"""

import matplotlib.pyplot as plt

from dpcourse.comm.cases import make_groups
from dpcourse.reference.shards import locate_slices
from dpcourse.runtime.inside_rank import to_cpu
from dpcourse.topics.tensor.runs import BUILDERS
from dpcourse.viz.colours import draw_cell, rank_colour


def local_parameters_of(cls, full, groups=None, **options):
    """Inside a rank: build cls(full module, group) and return {name: this rank's parameter}."""
    group, _ = make_groups(groups)
    kind, kwargs = full
    module = cls(BUILDERS[kind](**kwargs), group, **options)
    return to_cpu({name: p.detach().clone() for name, p in module.named_parameters()})


def full_parameters(full):
    """{name: tensor} of the unsharded module of a (builder, kwargs) spec, on the CPU."""
    kind, kwargs = full
    return {n: p.detach() for n, p in BUILDERS[kind](**dict(kwargs, device="cpu")).named_parameters()}


def holders(full, held, layout):
    """{name: grid of lists of ranks} holding each element of each full parameter, and the names of
    (rank, parameter) pairs that are not whole slices."""
    grids, strange = {}, []
    for name, tensor in full.items():
        rows, cols = (tensor.shape[0], tensor.shape[1]) if tensor.dim() == 2 else (tensor.shape[0], 1)
        grid = [[[] for _ in range(cols)] for _ in range(rows)]
        for rank, params in enumerate(held):
            local = params.get(name)
            if local is None:
                continue
            if layout[name] == "replicated":
                found = list(range(rows)) if local.shape == tensor.shape and local.equal(tensor) else None
                dim = 0
            else:
                dim = 0 if layout[name] == "column" or tensor.dim() == 1 else 1
                found = locate_slices(local, tensor, dim)
            if found is None:
                strange.append(f"rank {rank}'s {name}")
                continue
            for index in found:
                cells = [(index, c) for c in range(cols)] if dim == 0 else [(r, index) for r in range(rows)]
                for r, c in cells:
                    grid[r][c].append(rank)
        grids[name] = grid
    return grids, strange


def plot_weight_slices(full, held, layout, title=None):
    """One panel per parameter: its full shape, each element in the colours of the ranks holding it."""
    grids, strange = holders(full, held, layout)
    names = list(grids)
    widths = [max(len(grids[n][0]), 1) + 1.5 for n in names]
    height = max(len(g) for g in grids.values())
    fig, axes = plt.subplots(1, len(names), figsize=(min(2 + 0.22 * sum(widths), 15), 1 + 0.22 * height),
                             gridspec_kw=dict(width_ratios=widths), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        grid = grids[name]
        for r, row in enumerate(grid):
            for c, ranks in enumerate(row):
                draw_cell(ax, c, r, sorted(set(ranks)), width=0.95, height=0.95)
        ax.set_xlim(-0.2, len(grid[0]) + 0.2)
        ax.set_ylim(height + 0.2, -0.2)
        ax.set_aspect("equal")
        ax.axis("off")
        shape = "x".join(str(s) for s in full[name].shape)
        ax.set_title(f"{name}\n{shape}, {layout[name]}", fontsize=8)
    handles = [plt.Rectangle((0, 0), 1, 1, color=rank_colour(r)) for r in range(len(held))]
    fig.legend(handles, [f"rank {r}" for r in range(len(held))], loc="lower center", ncol=len(held),
               fontsize=8, frameon=False)
    heading = title or "which rank holds each element (white: nobody)"
    if strange:
        heading += "\nnot whole slices of the full weight: " + ", ".join(strange)
    fig.suptitle(heading, fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    plt.show()
    return fig
