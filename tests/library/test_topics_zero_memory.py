"""topics.zero.memory: the ZeRO paper's numbers, and what a rank holds, measured storage by storage."""

import pytest
import torch

from dpcourse.topics.zero.memory import (
    STAGES,
    format_decimal_bytes,
    held_bytes,
    implementation_bytes,
    model_state_bytes,
    optimizer_summary,
)
from dpcourse.topics.zero.units import FlatUnit
from dpcourse.toys.data import smooth_regression_data
from dpcourse.toys.models import deep_mlp, loss_fn
from markers import exercise


@exercise("memory_per_gpu", "plan", "mini_fsdp")
def test_the_papers_figure_1():
    # 7.5B parameters, mixed-precision Adam (K = 12), 64 GPUs: 120, 31.4, 16.6 and 1.9 GB per GPU
    totals = [sum(model_state_bytes(7.5e9, 64, stage).values()) / 1e9 for stage in STAGES]
    assert [round(t, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]
    assert model_state_bytes(1.5e9, 1, "DDP") == {"weights": 3e9, "gradients": 3e9, "optimizer": 18e9}
    assert format_decimal_bytes(31.40625e9) == "31.4 GB" and format_decimal_bytes(512) == "512 B"
    with pytest.raises(ValueError, match="stage must be one of"):
        model_state_bytes(1, 1, "ZeRO-4")


def stepped(model):
    X, Y = smooth_regression_data(8, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    loss_fn(model(X), Y).backward()
    opt.step()
    return opt


@exercise("reduce_scatter_gradients", "mini_fsdp")
def test_held_bytes_of_plain_training_is_weights_gradients_and_two_moments():
    model = deep_mlp(seed=0)
    held = held_bytes(model, stepped(model))
    S = 994 * 8
    assert held == {"weights": S, "gradients": S, "optimizer": 2 * S + 10 * 4}  # + a step counter per tensor
    assert implementation_bytes(994, 1, "DDP") == {"weights": S, "gradients": S, "optimizer": 2 * S}


@exercise("mini_fsdp")
def test_freed_units_hold_nothing_and_views_are_counted_once():
    model = deep_mlp(seed=0)
    units = [FlatUnit(model.fc1, "fc1"), FlatUnit(model.fc2, "fc2")]
    assert held_bytes(model)["weights"] == 994 * 8  # the views of each unit count once
    for unit in units:
        unit.free()
    assert held_bytes(model)["weights"] == (994 - 2 * 272) * 8


@exercise("sharded_optimizer")
def test_optimizer_summary_counts_storages_not_views():
    flat = torch.zeros(100, dtype=torch.float64)
    shard = flat[:40].requires_grad_(True)
    opt = torch.optim.AdamW([shard], lr=0.1)
    shard.grad = torch.ones(40, dtype=torch.float64)
    opt.step()
    summary = optimizer_summary(opt)
    assert summary["numel"] == 40 and summary["storage_bytes"] == 800  # the whole flat vector stays alive
    assert summary["state_bytes"] == 2 * 40 * 8 + 4 and sorted(summary["state"]) == ["exp_avg", "exp_avg_sq"]
    assert optimizer_summary(opt, [flat])["storage_bytes"] == 0  # a view of the model's own weights
