"""The hidden checks of 08_tensor_parallelism pass the reference layers (which the benchmark races), and
fail a layer that is right on one group but wrong on sub-groups."""

import pytest
import torch.distributed as dist
from torch import nn

from dpgrader.tensor_parallelism import tuned as tp
from dpgrader.tensor_parallelism.checks import (
    check_column_parallel_linear,
    check_copy_to_tp,
    check_gather_from_tp,
    check_reduce_from_tp,
    check_row_parallel_linear,
    check_tensor_parallel_attention,
    check_tensor_parallel_mlp,
)
from markers import exercise


@exercise("copy_to_tp", "reduce_from_tp", "gather_from_tp", "column_parallel_linear", "row_parallel_linear",
          "tensor_parallel_mlp", "tensor_parallel_attention")
def test_the_reference_layers_pass_every_hidden_check():
    check_copy_to_tp(tp.copy_to_tp)
    check_reduce_from_tp(tp.reduce_from_tp)
    check_gather_from_tp(tp.gather_from_tp)
    check_column_parallel_linear(tp.ColumnParallelLinear)
    check_row_parallel_linear(tp.RowParallelLinear)
    check_tensor_parallel_mlp(tp.TensorParallelMLP)
    check_tensor_parallel_attention(tp.TensorParallelAttention)


class RowSlicedByWorldRank(tp.RowParallelLinear):
    """Right whenever the group is the whole world."""

    def __init__(self, linear, group=None, input_is_parallel=True):
        super().__init__(linear, group, input_is_parallel)
        cols = linear.in_features // dist.get_world_size(group)
        r = dist.get_rank() % dist.get_world_size(group)
        self.weight = nn.Parameter(linear.weight.detach()[:, r * cols:(r + 1) * cols].clone())


@exercise("row_parallel_linear")
def test_a_slice_taken_by_world_rank_is_caught_on_sub_groups():
    where = r"RowParallelLinear on 4 rank\(s\), groups \[\[0, 2\], \[1, 3\]\]"
    with pytest.raises(AssertionError, match=where + ".*holds weight"):
        check_row_parallel_linear(RowSlicedByWorldRank)


HIDDEN_COLLECTIVE = '''
def copy_to_tp(x, group=None):
    return CopyToTP.apply(x, group)


class CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        from dpcourse.comm import recorder

        ctx.group = group
        hidden, recorder._active[:] = recorder._active[:], []      # out of the recorder's sight:
        dist.all_reduce(torch.zeros(1), group=group)                # a collective forward
        recorder._active[:] = hidden
        return x

    @staticmethod
    def backward(ctx, grad):
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None
'''


@exercise("copy_to_tp")
@pytest.mark.slow
def test_a_collective_hidden_from_the_recorder_is_caught_by_the_graders_router(tmp_path):
    import json
    import os
    import subprocess
    import sys

    from test_hostile_submissions import notebook

    from conftest import REPO

    path = notebook("08_tensor_parallelism", "course", {"copy_to_tp": HIDDEN_COLLECTIVE}, tmp_path, "hides")
    out = tmp_path / "verdicts.json"
    source = next((REPO / "solutions" / "08_tensor_parallelism").glob("*.ipynb"))
    env = dict(os.environ, PYTHONPATH=str(REPO / "autograder"), DPCOURSE_DEADLINE="20")
    proc = subprocess.run([sys.executable, "-m", "dpgrader.judge", str(source), str(path), "--only",
                           "test_copy_to_tp_basic", "--out", str(out)], capture_output=True, text=True,
                          timeout=600, env=env, cwd=REPO / "autograder")
    assert proc.returncode == 0, proc.stderr[-3000:]
    verdict = json.loads(out.read_text())["test_copy_to_tp_basic"]
    assert not verdict["passed"]
    expected = "as the grader's router saw them (all_reduce, all_reduce), but recorded 1"
    assert expected in verdict["evalue"], verdict
