"""Every torch.distributed collective, run for real on N ranks, drawn as buffers before and after.

Used by notebook 03 (collective_explorer).

    from dpcourse.topics.collectives.pictures import collective_explorer
    collective_explorer(4)          # a drop-down: pick a collective, see each rank's buffer

Why run them instead of drawing the textbook picture: what a learner sees is what gloo
(or NCCL) actually did, including the parts the API leaves undefined. Each collective runs
twice in the same launch: once on readable values (rank r's block i is 10·r + i) and once
on 2**r, whose sums tell which ranks each element came from (see maskpics).
"""

import torch
import torch.distributed as dist

from dpcourse.backend import rank_device
from dpcourse.runtime.launcher import launch
from dpcourse.viz import colours as maskpics
from dpcourse.viz.widgets import explorer

# name -> (the call as a learner writes it, what it does, what each rank sends in the classic algorithm)
COLLECTIVES = {
    "broadcast": ("dist.broadcast(t, src=0)", "rank 0's buffer is copied to every rank"),
    "reduce": ("dist.reduce(t, dst=0)", "the sum lands on rank 0 only; other buffers are undefined "
               "afterwards"),
    "all_reduce": ("dist.all_reduce(t)", "every rank ends with the sum of all buffers"),
    "gather": ("dist.gather(t, gather_list, dst=0)", "rank 0 collects one block from each rank"),
    "all_gather": ("dist.all_gather(out_list, t)", "every rank collects one block from each rank"),
    "scatter": ("dist.scatter(t, scatter_list, src=0)", "rank 0 hands block r to rank r"),
    "reduce_scatter": ("dist.reduce_scatter(t, in_list)", "block r of every rank is summed onto rank r"),
    "all_to_all": ("dist.all_to_all(out_list, in_list)", "rank r sends its block k to rank k: a "
                   "transpose"),
    "barrier": ("dist.barrier()", "no data moves: every rank waits until all have arrived"),
}


def _run_one(name, blocks):
    """On this rank: (buffers before, buffers after) for one collective; None = undefined/absent."""
    rank, world = dist.get_rank(), dist.get_world_size()
    t = blocks.clone()
    one = blocks[rank:rank + 1].clone()
    zeros = [torch.zeros_like(one) for _ in range(world)]
    if name == "broadcast":
        dist.broadcast(t, src=0)
        return [blocks], [t]
    if name == "reduce":
        dist.reduce(t, dst=0)
        return [blocks], [t if rank == 0 else None]
    if name == "all_reduce":
        dist.all_reduce(t)
        return [blocks], [t]
    if name == "gather":
        dist.gather(one, zeros if rank == 0 else None, dst=0)
        return [one], [torch.cat(zeros) if rank == 0 else None]
    if name == "all_gather":
        dist.all_gather(zeros, one)
        return [one], [torch.cat(zeros)]
    if name == "scatter":
        out = torch.zeros_like(one)
        dist.scatter(out, list(t.split(1)) if rank == 0 else None, src=0)
        return [blocks if rank == 0 else None], [out]
    if name == "reduce_scatter":
        out = torch.zeros_like(one)
        dist.reduce_scatter(out, list(t.split(1)))
        return [blocks], [out]
    if name == "all_to_all":
        dist.all_to_all(zeros, list(t.split(1)))
        return [blocks], [torch.cat(zeros)]
    if name == "barrier":
        dist.barrier()
        return [blocks], [blocks]
    raise ValueError(f"unknown collective {name!r}; choose one of {', '.join(COLLECTIVES)}")


def run_collectives(names=None):
    """Runs on every rank: each collective on values and on masks. Returns {name: (values, masks)}."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    values = torch.arange(world, dtype=torch.float64, device=device) + 10 * rank
    masks = torch.full((world,), float(2 ** rank), dtype=torch.float64, device=device)
    out = {}
    for name in names or COLLECTIVES:
        out[name] = tuple(([b.cpu() if b is not None else None for b in before],
                           [a.cpu() if a is not None else None for a in after])
                          for before, after in (_run_one(name, values), _run_one(name, masks)))
    return out


def collect(world_size=4, names=None):
    """Launch world_size ranks once, run every collective; returns a list of per-rank results."""
    return launch(run_collectives, world_size, names)


def draw(results, name, ax=None):
    """Two panels, before and after: one row per rank, cells coloured by where their data came from."""
    import matplotlib.pyplot as plt

    world = len(results)
    call, what = COLLECTIVES[name]
    if ax is None:
        fig, ax = plt.subplots(1, 2, figsize=(2.2 + 1.1 * world, 0.9 + 0.45 * world))
    else:
        fig = ax[0].figure
    for panel, (axis, title) in enumerate(zip(ax, ("before", "after"), strict=True)):
        for rank, per_rank in enumerate(results):
            (values_before, values_after), (masks_before, masks_after) = per_rank[name]
            buffers = (values_before, masks_before) if panel == 0 else (values_after, masks_after)
            x = 0
            for values, masks in zip(*buffers, strict=True):
                if values is None:
                    axis.text(x + 0.1, rank + 0.4, "(undefined)" if panel else "(no input)",
                              va="center", fontsize=8, color="#888888")
                    x += world
                    continue
                for v, m in zip(values.tolist(), masks.tolist(), strict=True):
                    maskpics.draw_cell(axis, x, rank, maskpics.ranks_in(m, world), f"{v:g}")
                    x += 1
        axis.set_xlim(-0.1, world + 0.1)
        maskpics.rank_axis(axis, world)
        axis.set_title(title, fontsize=10)
    maskpics.legend(ax[1], world)
    fig.suptitle(f"{call}: {what}", fontsize=10)
    fig.tight_layout()
    return fig


def collective_explorer(world_size=4, default="all_reduce"):
    """A drop-down over the collectives; every picture comes from one real launch of world_size ranks."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    results = collect(world_size)

    def show(collective):
        draw(results, collective)
        plt.show()

    menu = widgets.Dropdown(options=list(COLLECTIVES), value=default, description="collective")
    return explorer({"collective": menu}, show)
