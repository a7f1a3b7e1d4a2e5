"""dpcourse.topics.tensor.layers (notebook 09's tensor-parallel layers, DTensor placements), realapi
(torch's parallelize_module next to a learner's layers) and pictures (who holds which slice)."""

import matplotlib
import pytest
import torch.distributed as dist

matplotlib.use("Agg")

from dpcourse import launch  # noqa: E402
from dpcourse.topics.tensor import layers  # noqa: E402
from dpcourse.topics.tensor.checks import (  # noqa: E402
    ATTENTION,
    COLUMN,
    MLP,
    ROW,
    expect_module,
    expect_training,
)
from dpcourse.topics.tensor.models import inputs  # noqa: E402
from dpcourse.topics.tensor.pictures import (  # noqa: E402
    full_parameters,
    holders,
    local_parameters_of,
    plot_weight_slices,
)
from dpcourse.topics.tensor.realapi import as_reference, side_by_side, tp_mesh  # noqa: E402
from dpcourse.topics.tensor.runs import run_module_cases, run_training  # noqa: E402
from dpgrader.tensor_parallelism import tuned as tp  # noqa: E402
from markers import chapter, exercise  # noqa: E402

GROUPS = [[0, 1], [2, 3]]
GATHER = ("all_gather", "all_gather_into_tensor")


def on_mesh(cls):
    """The library layers take a 1-D DeviceMesh; the runners hand a process group."""
    def build(full, group, **options):
        return cls(full, tp_mesh(group), **options)
    return build


@exercise("hybrid_dp_tp_step")
@chapter("tensor_parallelism")
def test_the_library_layers_equal_the_unsharded_modules_with_one_collective_each_way():
    x, dy = inputs((2, 3, 8), seed=1), inputs((2, 3, 12), seed=2)
    linear = ("linear", dict(in_features=8, out_features=12, seed=3))
    cases = [dict(full=linear, options={}, x=x, dy=dy, output="parallel", groups=GROUPS, label="column"),
             dict(full=linear, options=dict(gather_output=True), x=x, dy=dy, groups=GROUPS, label="gathered")]
    runs = run_module_cases(on_mesh(layers.ColumnParallelLinear), 4, cases, exercise="column")
    expect_module(runs[0], cases[0], COLUMN, "column", forward=[], backward=[("all_reduce", x.numel() * 8)])
    expect_module(runs[1], cases[1], COLUMN, "gathered", forward=[(GATHER, None)],
                  backward=[("all_reduce", x.numel() * 8)])
    row = ("linear", dict(in_features=8, out_features=6, seed=4))
    dy_row = inputs((2, 3, 6), seed=5)
    cases = [dict(full=row, options={}, x=x, dy=dy_row, input="parallel", groups=GROUPS, label="row"),
             dict(full=row, options=dict(input_is_parallel=False), x=x, dy=dy_row, groups=GROUPS,
                  label="split")]
    runs = run_module_cases(on_mesh(layers.RowParallelLinear), 4, cases, exercise="row")
    expect_module(runs[0], cases[0], ROW, "row", forward=[("all_reduce", dy_row.numel() * 8)], backward=[])
    expect_module(runs[1], cases[1], ROW, "split", forward=[("all_reduce", dy_row.numel() * 8)],
                  backward=[(GATHER, None)])


@chapter("tensor_parallelism")
@pytest.mark.parametrize("kind, cls, layout", [pytest.param("mlp", layers.TensorParallelMLP, MLP,
                                                            marks=exercise("hybrid_dp_tp_step")),
                                               ("attention", layers.TensorParallelAttention, ATTENTION)])
def test_the_library_blocks_train_like_the_unsharded_ones(kind, cls, layout):
    sizes = dict(d_model=8, d_hidden=16) if kind == "mlp" else dict(d_model=8, n_heads=4)
    full = (kind, dict(sizes, seed=0))
    case = dict(full=full, groups=GROUPS, lr=0.2, label=kind,
                batches=[(inputs((2, 3, 8), seed=s), inputs((2, 3, 8), seed=10 + s)) for s in range(3)])
    size = [("all_reduce", 2 * 3 * 8 * 8)]
    expect_training(run_training(on_mesh(cls), 4, case, exercise=kind), case, layout, kind, forward=size,
                    backward=size)


def refuse_a_process_group():
    try:
        layers.ColumnParallelLinear(tp.ColumnParallelLinear, dist.group.WORLD)
    except TypeError as exc:
        return str(exc)
    return "accepted"


@exercise("hybrid_dp_tp_step")
@chapter("tensor_parallelism")
def test_the_library_layers_want_a_device_mesh():
    assert "expected a 1-D DeviceMesh" in launch(refuse_a_process_group, 1)[0]


@exercise("tensor_parallel_mlp", "tensor_parallel_attention")
def test_parallelize_module_and_the_reference_layers_agree_and_communicate_alike():
    full = ("mlp", dict(d_model=8, d_hidden=32, seed=0))
    x, dy = inputs((4, 8), seed=1), inputs((4, 8), seed=2)
    rows = launch(side_by_side, 2, tp.TensorParallelMLP, full, x, dy)[0]
    y, x_grad = as_reference(full, x, dy)
    for name, (out, grad, forward, backward, _) in rows.items():
        assert (out - y).abs().max() < 1e-12 and (grad - x_grad).abs().max() < 1e-12, name
        assert [(o.op, o.nbytes) for o in forward] == [("all_reduce", 4 * 8 * 8)], name
        assert [(o.op, o.nbytes) for o in backward] == [("all_reduce", 4 * 8 * 8)], name
    assert rows["yours"][4] == []
    assert {o.op for o in rows["parallelize_module"][4]} == {"scatter", "broadcast"}


@exercise("tensor_parallel_mlp")
def test_the_picture_shows_who_holds_what():
    full = ("mlp", dict(d_model=4, d_hidden=8, seed=0))
    held = launch(local_parameters_of, 2, tp.TensorParallelMLP, full)
    grids, strange = holders(full_parameters(full), held, MLP)
    assert strange == []
    assert grids["fc1.weight"][0][0] == [0] and grids["fc1.weight"][7][3] == [1]     # rows: rank 0, then 1
    assert grids["fc2.weight"][0][0] == [0] and grids["fc2.weight"][3][7] == [1]     # columns
    assert grids["fc2.bias"][2][0] == [0, 1]                                          # replicated
    held[1]["fc1.weight"] = held[1]["fc1.weight"] * 2
    _, strange = holders(full_parameters(full), held, MLP)
    assert strange == ["rank 1's fc1.weight"]
    assert plot_weight_slices(full_parameters(full), held, MLP) is not None
