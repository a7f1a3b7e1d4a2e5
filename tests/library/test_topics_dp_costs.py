"""dpcourse.topics.data_parallel.costs:
byte counts of nn.DataParallel vs DDP, and the timers the notebook uses.
"""

import pytest
import torch

from dpcourse.topics.data_parallel.costs import (
    big_matmul_model,
    copy_cost,
    dataparallel_traffic,
    many_small_ops_model,
    parameter_bytes,
    print_traffic,
    speedup_with_threads,
    time_call,
)
from dpcourse.toys.models import mlp
from markers import exercise

pytestmark = exercise("mini_data_parallel")


def test_traffic_of_resnet50_on_8_gpus():
    t = dataparallel_traffic(model_bytes=102.4e6, input_bytes=154e6, output_bytes=1.024e6, devices=8)
    assert t["replicate: model broadcast to the other devices"] == pytest.approx(7 * 102.4e6)
    assert t["reduce: every replica's gradients summed on device 0"] == pytest.approx(7 * 102.4e6)
    assert t["scatter: batch pieces leave device 0"] == pytest.approx(154e6 * 7 / 8)
    assert t["DDP, for comparison: one GPU sends in a ring all-reduce"] == pytest.approx(2 * 7 / 8 * 102.4e6)


def test_one_device_moves_nothing(capsys):
    t = dataparallel_traffic(100, 50, 10, devices=1)
    assert all(v == 0 for v in t.values())
    print_traffic(t, "one device")
    assert "DataParallel, all through device 0" in capsys.readouterr().out


def test_parameter_bytes_counts_parameters_and_buffers():
    assert parameter_bytes(torch.nn.Linear(3, 2)) == (6 + 2) * 4
    assert parameter_bytes(mlp(2, 4, 1, batchnorm=True)) > parameter_bytes(mlp(2, 4, 1))


def test_timers_return_positive_seconds():
    assert time_call(lambda: sum(range(100)), repeats=3) > 0
    copy_s, step_s = copy_cost(mlp(4, 8, 1), torch.randn(8, 4), devices=3)
    assert copy_s > 0 and step_s > 0
    assert len(list(many_small_ops_model(depth=3).children())) == 6
    assert big_matmul_model(width=8)(torch.randn(2, 8)).shape == (2, 8)


def test_speedup_with_threads_runs_a_wrapper():
    calls = []

    def wrap(module, devices):
        calls.append(len(devices))
        return module

    results = speedup_with_threads(wrap, [torch.device("cpu")] * 2, repeats=1)
    assert len(results) == 2 and calls == [2, 2]
    assert all(plain > 0 and wrapped > 0 for plain, wrapped in results.values())
