"""A grid of ranks, dp x pp x tp: each rank's coordinates and its process group along each axis.

    grid = Grid(sizes={"dp": 2, "pp": 1, "tp": 2}, coords={"dp": 1, "pp": 0, "tp": 0},
                groups={"dp": <ProcessGroup>, "pp": <ProcessGroup>, "tp": <ProcessGroup>})
    grid.members("tp")          # (2, 3): the world ranks of this rank's tensor-parallel group
    grid, mesh = mesh_grid(dp=2, tp=2)    # inside a rank: the same Grid built by init_device_mesh

Why one grid derives every group: hybrid parallelism runs several kinds of communication at
once (tensor-parallel all-reduces of activations, pipeline sends, data-parallel all-reduces of
gradients), each inside its own group, and the groups must tile the world consistently. So,
as in picotron's process_group_manager and in torch's DeviceMesh, the ranks are laid out as
one array, `torch.arange(world).view(dp, pp, tp)`, and a rank's coordinates are its position
in it; the group of an axis is the line of the array through the rank along that axis. The
last axis varies fastest: ranks r and r + 1 are neighbours along tp (inside one node on a
real cluster, where tensor parallelism's blocking all-reduces need NVLink). Unlike picotron
there is no global singleton: a Grid is a plain object handed to whoever needs it.

`init_device_mesh(device, (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))` builds exactly
this layout (torch/distributed/device_mesh.py: its rank map is `torch.arange(n)` laid out
with row-major strides by `_MeshLayout.from_sizes_strides`), which `mesh_grid` turns into a
Grid; the course's runners use it, so that exercises on a grid never depend on the learner's
own `make_grid_groups`. Used by notebook 09.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

AXES = ("dp", "pp", "tp")  # slowest to fastest, as init_device_mesh lays out a (dp, pp, tp) mesh


@dataclass
class Grid:
    """This rank's place in a dp x pp x tp grid of ranks.

    sizes:  {"dp": ..., "pp": ..., "tp": ...}, how many ranks along each axis;
    coords: this rank's index along each axis;
    groups: the process group along each axis (a group of one rank where the axis has size 1).
    """

    sizes: dict
    coords: dict
    groups: dict

    def members(self, axis):
        """The world ranks of this rank's group along `axis`, in group-rank order."""
        return tuple(dist.get_process_group_ranks(self.groups[axis]))

    def size(self, axis):
        return self.sizes[axis]

    def __repr__(self):
        shape = " x ".join(f"{axis} {self.sizes[axis]}" for axis in AXES)
        where = ", ".join(f"{axis}={self.coords[axis]}" for axis in AXES)
        return f"Grid({shape}; this rank at {where})"


def check_sizes(dp, pp, tp, world_size):
    """A clear ValueError unless dp, pp, tp are positive ints whose product is the world size."""
    for axis, size in zip(AXES, (dp, pp, tp), strict=True):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{axis} must be a positive int, got {size!r}")
    if dp * pp * tp != world_size:
        raise ValueError(f"a grid of dp {dp} x pp {pp} x tp {tp} = {dp * pp * tp} ranks does not match "
                         f"the world size {world_size}")


def mesh_grid(dp, tp, pp=1, device_type=None, timeout=None):
    """Inside a rank: (Grid, DeviceMesh) of a dp x pp x tp grid built with torch's init_device_mesh.

    timeout: seconds a collective on the new groups may wait. torch gives a new group its
    backend's default (30 minutes for gloo), not the world group's, so a test that must turn a
    hang into an error in seconds passes its own.
    """
    from datetime import timedelta

    import torch.distributed.distributed_c10d as c10d
    from torch.distributed.device_mesh import init_device_mesh

    from dpcourse.backend import rank_device

    check_sizes(dp, pp, tp, dist.get_world_size())
    device_type = device_type or rank_device().type
    default = c10d.default_pg_timeout
    if timeout is not None:
        c10d.default_pg_timeout = timedelta(seconds=timeout)
    try:
        mesh = init_device_mesh(device_type, (dp, pp, tp), mesh_dim_names=AXES)
    finally:
        c10d.default_pg_timeout = default
    coords = dict(zip(AXES, mesh.get_coordinate(), strict=True))
    groups = {axis: mesh[axis].get_group() for axis in AXES}
    return Grid({"dp": dp, "pp": pp, "tp": tp}, coords, groups), mesh


def layout(dp, pp, tp):
    """The grid as init_device_mesh lays it out: layout(dp, pp, tp)[d, p, t] is a world rank."""
    return torch.arange(dp * pp * tp).view(dp, pp, tp)


def axis_groups(dp, pp, tp, axis):
    """Every group along `axis` of a (dp, pp, tp) grid, as lists of world ranks (DeviceMesh's cut)."""
    mesh = layout(dp, pp, tp)
    dim = AXES.index(axis)
    return [row.tolist() for row in mesh.movedim(dim, -1).reshape(-1, mesh.shape[dim])]


def expected_grid(dp, tp, pp=1):
    """Per world rank: {"coords": {axis: index}, "members": {axis: world ranks of its group}}."""
    mesh = layout(dp, pp, tp)
    out = []
    for rank in range(mesh.numel()):
        position = [int(i) for i in (mesh == rank).nonzero()[0]]
        coords = dict(zip(AXES, position, strict=True))
        members = {axis: next(g for g in axis_groups(dp, pp, tp, axis) if rank in g) for axis in AXES}
        out.append({"coords": coords, "members": members})
    return out
