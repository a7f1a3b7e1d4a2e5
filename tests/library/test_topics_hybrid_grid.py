"""dpcourse.topics.hybrid.grid (the Grid, init_device_mesh's layout) and the grid half of runs and
checks: the expected groups are init_device_mesh's own, creation order is watched, and the known
mistakes (another order on some ranks, only a rank's own groups, dp and tp swapped) are named."""

import pytest
import torch
import torch.distributed as dist

from dpcourse import launch
from dpcourse.topics.hybrid.checks import expect_bad_sizes_refused, expect_grid
from dpcourse.topics.hybrid.grid import AXES, Grid, axis_groups, check_sizes, expected_grid, layout, mesh_grid
from dpcourse.topics.hybrid.runs import ORDER_RULE, run_grid_cases
from dpgrader.hybrid_parallelism.tuned import make_grid_groups
from markers import exercise

pytestmark = exercise("make_grid_groups")

SHAPES = {4: [(2, 2, 1), (1, 4, 1), (4, 1, 1), (1, 2, 2), (2, 1, 2)], 8: [(2, 2, 2), (2, 4, 1), (1, 2, 4)]}


def _live_mesh(shapes):
    out = []
    for dp, tp, pp in shapes:
        grid, mesh = mesh_grid(dp, tp=tp, pp=pp)
        out.append({"coords": grid.coords, "members": {a: list(grid.members(a)) for a in AXES},
                    "mesh": mesh.mesh.tolist()})
    return out


@pytest.mark.parametrize("world", [4, 8])
def test_expected_grid_is_what_init_device_mesh_builds(world):
    per_rank = launch(_live_mesh, world, SHAPES[world])
    for index, (dp, tp, pp) in enumerate(SHAPES[world]):
        expected = expected_grid(dp, tp, pp)
        for rank in range(world):
            live = per_rank[rank][index]
            assert live["mesh"] == layout(dp, pp, tp).tolist()
            assert live["coords"] == expected[rank]["coords"], (dp, tp, pp, rank)
            assert live["members"] == expected[rank]["members"], (dp, tp, pp, rank)


def test_layout_puts_tp_fastest_and_groups_tile_the_world():
    assert layout(2, 2, 2)[1, 0, 1].item() == 5
    assert expected_grid(2, 2, 2)[5] == {"coords": {"dp": 1, "pp": 0, "tp": 1},
                                         "members": {"dp": [1, 5], "pp": [5, 7], "tp": [4, 5]}}
    for axis in AXES:
        groups = axis_groups(2, 2, 2, axis)
        assert sorted(r for g in groups for r in g) == list(range(8))


def test_check_sizes_refuses_grids_that_do_not_fit():
    check_sizes(2, 1, 2, 4)
    with pytest.raises(ValueError, match="does not match the world size 4"):
        check_sizes(2, 1, 3, 4)
    with pytest.raises(ValueError, match="positive int"):
        check_sizes(0, 1, 4, 4)


def _grid_repr():
    grid, _ = mesh_grid(2, tp=2)
    return repr(grid), grid.size("tp"), isinstance(grid, Grid)


def test_grid_repr_names_the_rank_s_place():
    text, size, is_grid = launch(_grid_repr, 4)[3]
    assert "dp=1, pp=0, tp=1" in text and size == 2 and is_grid


def test_a_correct_grid_passes_every_shape_and_a_bad_size_is_refused():
    for world, shapes in SHAPES.items():
        cases = [dict(dp=dp, tp=tp, pp=pp) for dp, tp, pp in shapes] + [dict(dp=world, tp=2)]
        reports = run_grid_cases(make_grid_groups, world, cases)
        for case, case_reports in zip(cases[:-1], reports[:-1], strict=True):
            expect_grid(case_reports, case, str(case))
            assert all(r["created"] == case_reports[0]["created"] for r in case_reports)
        expect_bad_sizes_refused(reports[-1], "bad")


def groups_in_another_order(dp, tp, pp=1):
    rank, mesh = dist.get_rank(), layout(dp, pp, tp)
    order = AXES if rank % 2 == 0 else AXES[::-1]
    groups = {}
    for axis in order:
        dim = AXES.index(axis)
        for line in mesh.movedim(dim, -1).reshape(-1, mesh.shape[dim]).tolist():
            group = dist.new_group(line)
            if rank in line:
                groups[axis] = group
    coords = dict(zip(AXES, [int(i) for i in (mesh == rank).nonzero()[0]], strict=True))
    return Grid({"dp": dp, "pp": pp, "tp": tp}, coords, groups)


def only_own_groups(dp, tp, pp=1):
    rank, mesh = dist.get_rank(), layout(dp, pp, tp)
    groups = {}
    for dim, axis in enumerate(AXES):
        for line in mesh.movedim(dim, -1).reshape(-1, mesh.shape[dim]).tolist():
            if rank in line:
                groups[axis] = dist.new_group(line)
    coords = dict(zip(AXES, [int(i) for i in (mesh == rank).nonzero()[0]], strict=True))
    return Grid({"dp": dp, "pp": pp, "tp": tp}, coords, groups)


def swapped(dp, tp, pp=1):
    rank = dist.get_rank()
    mesh = torch.arange(dp * pp * tp).view(tp, pp, dp).permute(2, 1, 0)
    groups = {}
    for dim, axis in enumerate(AXES):
        for line in mesh.movedim(dim, -1).reshape(-1, mesh.shape[dim]).tolist():
            group = dist.new_group(sorted(line))
            if rank in line:
                groups[axis] = group
    coords = dict(zip(AXES, [int(i) for i in (mesh == rank).nonzero()[0]], strict=True))
    return Grid({"dp": dp, "pp": pp, "tp": tp}, coords, groups)


@pytest.mark.parametrize("fn, message", [(groups_in_another_order, ORDER_RULE), (only_own_groups, ORDER_RULE),
                                         (swapped, "dp and tp are swapped")])
def test_known_mistakes_are_named_without_hanging(fn, message):
    case = dict(dp=2, tp=2)
    reports = run_grid_cases(fn, 4, [case])[0]
    with pytest.raises(AssertionError, match=message):
        expect_grid(reports, case, "2 x 2")


def none_for_an_axis_of_one(dp, tp, pp=1):
    grid = make_grid_groups(dp, tp, pp=pp)
    groups = {axis: (None if grid.sizes[axis] == 1 else group) for axis, group in grid.groups.items()}
    return Grid(grid.sizes, grid.coords, groups)


def test_a_missing_group_of_an_axis_of_one_is_named_not_taken_for_swapped_axes():
    case = dict(dp=1, tp=4)  # dp of size 1: its layout with dp and tp swapped is the same
    reports = run_grid_cases(none_for_an_axis_of_one, 4, [case])[0]
    with pytest.raises(AssertionError, match="grid.groups\\['dp'\\] is None") as error:
        expect_grid(reports, case, "1 x 4")
    assert "swapped" not in str(error.value) and "a group of one rank" in str(error.value)


def accepts_a_smaller_grid(dp, tp, pp=1):
    if dp * pp * tp > dist.get_world_size():
        raise ValueError("too big")
    rank, mesh = dist.get_rank(), layout(dp, pp, tp)
    groups = {}
    for dim, axis in enumerate(AXES):
        for line in mesh.movedim(dim, -1).reshape(-1, mesh.shape[dim]).tolist():
            group = dist.new_group(line)
            if rank in line:
                groups[axis] = group
    return Grid({"dp": dp, "pp": pp, "tp": tp}, {"dp": 0, "pp": 0, "tp": rank % tp}, groups)


def test_a_grid_smaller_than_the_world_must_be_refused_too():
    cases = [dict(dp=3, tp=2), dict(dp=1, tp=2)]
    larger, smaller = run_grid_cases(accepts_a_smaller_grid, 4, cases)
    expect_bad_sizes_refused(larger, "3 x 2", cases[0])
    with pytest.raises(AssertionError, match="2 is smaller than the world size 4: ranks 2 .. 3"):
        expect_bad_sizes_refused(smaller, "1 x 2", cases[1])
    expect_bad_sizes_refused(run_grid_cases(make_grid_groups, 4, cases[1:])[0], "1 x 2", cases[1])


def pp_and_tp_swapped(dp, tp, pp=1):
    """pp varies fastest: rank = (d·tp + t)·pp + p."""
    rank = dist.get_rank()
    mesh = torch.arange(dp * pp * tp).view(dp, tp, pp).permute(0, 2, 1)  # [d, p, t]
    groups = {}
    for dim, axis in enumerate(AXES):
        for line in mesh.movedim(dim, -1).reshape(-1, mesh.shape[dim]).tolist():
            group = dist.new_group(sorted(line))
            if rank in line:
                groups[axis] = group
    coords = dict(zip(AXES, [int(i) for i in (mesh == rank).nonzero()[0]], strict=True))
    return Grid({"dp": dp, "pp": pp, "tp": tp}, coords, groups)


def dp_spanning_the_pipeline(dp, tp, pp=1):
    """Right coordinates, tp and pp groups; dp groups of every rank with the same tp coordinate."""
    rank, world, mesh = dist.get_rank(), dp * pp * tp, layout(dp, pp, tp)
    lines = {"dp": [[r for r in range(world) if r % tp == t] for t in range(tp)],
             "pp": mesh.movedim(1, -1).reshape(-1, pp).tolist(), "tp": mesh.reshape(-1, tp).tolist()}
    groups = {}
    for axis in AXES:
        for line in lines[axis]:
            group = dist.new_group(line)
            if rank in line:
                groups[axis] = group
    coords = dict(zip(AXES, [int(i) for i in (mesh == rank).nonzero()[0]], strict=True))
    return Grid({"dp": dp, "pp": pp, "tp": tp}, coords, groups)


@pytest.mark.parametrize("fn, message", [
    (pp_and_tp_swapped, r"rank 0's pp group has members \[0, 1\], .* -- pp and tp are swapped \(pp varies "
                        r"fastest\)"),
    (dp_spanning_the_pipeline, r"rank 0's dp group has members \[0, 2, 4, 6\], expected \[0, 4\] .* -- the "
                               r"dp group spans the pipeline stages too"),
])
def test_each_wrong_3d_layout_is_named_for_what_it_is_not_taken_for_dp_and_tp_swapped(fn, message):
    case = dict(dp=2, tp=2, pp=2)
    reports = run_grid_cases(fn, 8, [case])[0]
    with pytest.raises(AssertionError, match=message) as error:
        expect_grid(reports, case, "2 x 2 x 2")
    assert "dp and tp are swapped" not in str(error.value)
