"""Unit tests of notebook 06's library modules: images, smallcnn, ddp_reference, scaling, cluster.

Fast: no notebook, and at most one tiny launch.
"""

import math
import sys
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from dpcourse import launch
from dpcourse.reference.training import (
    global_order,
    sampler_orders,
    single_process_training,
    strip_module_prefix,
)
from dpcourse.runtime.cluster import (
    cluster_command_lines,
    export_function,
    free_port,
    parse_args,
    pick_backend,
    shell_line,
    slurm_script,
    torchrun_command,
)
from dpcourse.topics.ddp.checks import (
    expect_losses,
    expect_rank_zero_writes,
    expect_run_results,
    expect_same_state,
    expect_sampler_behaviour,
    with_save_log,
)
from dpcourse.topics.ddp.scaling import efficiency, predicted_efficiency, ring_all_reduce_seconds
from dpcourse.toys.images import GeneratedImages
from dpcourse.toys.smallcnn import SmallCNN, parameter_count
from markers import exercise

# ------------------------------------------------------------------ images and model

def test_generated_images_are_deterministic_and_indexed():
    a, b = GeneratedImages(20, seed=3), GeneratedImages(20, seed=3)
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.images, GeneratedImages(20, seed=4).images)
    image, label, index = a[7]
    assert image.shape == (1, 12, 12) and 0 <= int(label) < 4 and index == 7
    assert GeneratedImages(5, size=8, dtype=torch.float64).images.dtype == torch.float64
    assert set(GeneratedImages(200).labels.tolist()) == {0, 1, 2, 3}


def test_generated_images_are_learnable_by_small_cnn():
    torch.manual_seed(0)
    data, model = GeneratedImages(256, seed=1), SmallCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(4):
        for start in range(0, 256, 32):
            loss = F.cross_entropy(model(data.images[start:start + 32]), data.labels[start:start + 32])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    held_out = GeneratedImages(128, seed=2)
    with torch.no_grad():
        accuracy = (model(held_out.images).argmax(1) == held_out.labels).double().mean().item()
    assert accuracy > 0.6, accuracy


@pytest.mark.parametrize("norm", ["group", "batch", None])
def test_small_cnn_shapes_and_norms(norm):
    model = SmallCNN(width=6, norm=norm, dtype=torch.float64)
    out = model(torch.randn(3, 1, 12, 12, dtype=torch.float64))
    assert out.shape == (3, 4) and out.dtype == torch.float64
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules()) == (norm == "batch")


def test_small_cnn_size():
    assert parameter_count(SmallCNN()) == 2564
    with pytest.raises(ValueError, match="norm must be"):
        SmallCNN(norm="layer")


# ------------------------------------------------------------------ the single-process yardstick

@exercise("train_ddp")
def test_global_order_matches_distributed_sampler_and_pads():
    orders = sampler_orders(10, 4, seed=0, epoch=1)
    assert [len(o) for o in orders] == [3, 3, 3, 3]
    order = global_order(10, 4, seed=0, epoch=1)
    assert sorted(set(order)) == list(range(10)) and len(order) == 12
    for rank in range(4):
        sampler = DistributedSampler(range(10), num_replicas=4, rank=rank, seed=0)
        sampler.set_epoch(1)
        assert order[rank::4] == list(sampler)
    assert global_order(10, 4, seed=0, epoch=2) != order


@exercise("train_ddp")
def test_single_process_training_on_one_rank_is_plain_minibatch_sgd():
    data = GeneratedImages(12, size=8, seed=1, dtype=torch.float64)
    make = partial(SmallCNN, width=3, dtype=torch.float64)
    got = single_process_training(make, data, epochs=1, global_batch=4, lr=0.1, seed=2, world_size=1)
    torch.manual_seed(2)
    model = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    order = torch.randperm(12, generator=torch.Generator().manual_seed(2)).tolist()
    total = 0.0
    for start in range(0, 12, 4):
        batch = order[start:start + 4]
        loss = F.cross_entropy(model(data.images[batch]), data.labels[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total += loss.item() * 4
    expect_same_state(got["model"], model.state_dict(), "one-rank reference", atol=0, rtol=0)
    assert got["losses"] == {0: total / 12}
    with pytest.raises(ValueError, match="does not split"):
        single_process_training(make, data, epochs=1, global_batch=5, lr=0.1, seed=2, world_size=2)


@exercise("train_ddp")
def test_expect_same_state_names_the_entry_and_accepts_the_ddp_prefix():
    state = {"a.weight": torch.zeros(2), "b": torch.ones(1)}
    expect_same_state({"module.a.weight": torch.zeros(2), "module.b": torch.ones(1)}, state, "x")
    assert strip_module_prefix({"module.k": 1}) == {"k": 1}
    message = r"rank 1: p: b is tensor\(\[1.5\].* \(largest difference 0.5\) .*\(hint\)$"
    with pytest.raises(AssertionError, match=message):
        expect_same_state({"a.weight": torch.zeros(2), "b": torch.tensor([1.5])}, state, "p", rank=1,
                          hint="hint")
    with pytest.raises(AssertionError, match="return model.module.state_dict"):
        expect_same_state({"a.weight": torch.zeros(2)}, state, "p")
    with pytest.raises(AssertionError, match="should return a dict with keys"):
        expect_run_results([{"model": {}, "seen": {}, "losses": {}}, None])


def good_seen(n, world, seed, epochs):
    return [{"seen": {e: sampler_orders(n, world, seed, e)[r] for e in epochs}} for r in range(world)]


@exercise("train_ddp")
def test_sampler_diagnosis_accepts_distributed_sampler():
    expect_sampler_behaviour(good_seen(10, 4, 5, [0, 1, 2]), 10, 4, 5, [0, 1, 2])
    expect_sampler_behaviour(good_seen(9, 1, 5, [2]), 9, 1, 5, [2])


@exercise("train_ddp")
@pytest.mark.parametrize("bug, message", [
    ("same_data", "every rank trained on the same samples"),
    ("no_set_epoch", "call sampler.set_epoch(epoch)"),
    ("seed_per_rank", "must shuffle with the same seed"),
    ("wrong_epochs", "should map each epoch trained [0, 1]"),
    ("unshuffled", "expected DistributedSampler's order"),
])
def test_sampler_diagnosis_names_the_mistake(bug, message):
    n, world, seed = 12, 3, 1
    results = good_seen(n, world, seed, [0, 1])
    if bug == "same_data":
        for r in results:
            r["seen"] = {e: global_order(n, 1, seed, e)[:4] for e in (0, 1)}
    elif bug == "no_set_epoch":
        for result in results:
            result["seen"][1] = list(result["seen"][0])
    elif bug == "seed_per_rank":
        for r, result in enumerate(results):
            result["seen"] = {e: sampler_orders(n, world, seed + r, e)[r] for e in (0, 1)}
    elif bug == "wrong_epochs":
        results[1]["seen"] = {0: results[1]["seen"][0]}
    elif bug == "unshuffled":
        for r, result in enumerate(results):
            result["seen"] = {e: list(range(r, n, world)) for e in (0, 1)}
            result["seen"][1] = result["seen"][1][::-1]
    with pytest.raises(AssertionError) as info:
        expect_sampler_behaviour(results, n, world, seed, [0, 1])
    assert message in str(info.value)


@exercise("train_ddp")
def test_expect_losses_explains_unreduced_losses():
    expect_losses([{"losses": {0: 1.0}}, {"losses": {0: 1.0}}], {0: 1.0})
    with pytest.raises(AssertionError, match="the ranks disagree"):
        expect_losses([{"losses": {0: 0.5}}, {"losses": {0: 1.5}}], {0: 1.0})
    with pytest.raises(AssertionError, match="should map each epoch trained"):
        expect_losses([{"losses": [1.0]}], {0: 1.0})


@exercise("train_ddp")
def test_save_log_and_rank_zero_rule(tmp_path):
    result, saves = with_save_log(lambda: torch.save({"x": 1}, tmp_path / "checkpoint.pt") or 7)
    assert result == 7 and saves == [str(tmp_path / "checkpoint.pt")]
    assert torch.save.__name__ == "save"
    expect_rank_zero_writes([saves, []], tmp_path)
    with pytest.raises(AssertionError, match="rank 1 wrote the checkpoint"):
        expect_rank_zero_writes([saves, saves], tmp_path)
    with pytest.raises(AssertionError, match="rank 0 did not write"):
        expect_rank_zero_writes([[], []], tmp_path / "elsewhere")


# ------------------------------------------------------------------ scaling

@exercise("train_ddp")
def test_efficiency_and_the_ring_model():
    assert efficiency({1: 100.0, 2: 150.0, 4: 200.0}) == {1: 1.0, 2: 0.75, 4: 0.5}
    with pytest.raises(ValueError):
        efficiency({2: 1.0})
    assert ring_all_reduce_seconds(1e9, 1, 1e9) == 0.0
    assert math.isclose(ring_all_reduce_seconds(1e9, 4, 1e9), 1.5)  # 2 (N-1)/N of the buffer
    fast = predicted_efficiency([1, 8, 64], 0.1, 1e8, inter_bandwidth=40e9)
    slow = predicted_efficiency([1, 8, 64], 0.1, 1e8, inter_bandwidth=1e9)
    assert fast[1] == slow[1] == 1.0 and fast[8] == slow[8] and slow[64] < fast[64] < fast[8]
    assert predicted_efficiency([64], 0.1, 1e8, inter_bandwidth=1e9, overlap=1.0)[64] > 0.99


@exercise("train_ddp")
def test_scaling_step_timer_runs_on_two_ranks():
    from dpcourse.topics.ddp.scaling import ddp_steps_per_second

    seconds = launch(ddp_steps_per_second, 2, 4, 2, 1, 4)
    assert len(seconds) == 2 and all(s > 0 for s in seconds)


# ------------------------------------------------------------------ cluster

def test_torchrun_commands():
    one = torchrun_command("m:f", ["--epochs", 2], nproc_per_node=4)
    assert one[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--standalone" in one and "--nproc-per-node=4" in one
    assert one[-4:] == ["dpcourse.runtime.cluster", "m:f", "--epochs", "2"]
    two = torchrun_command("m:f", [], nproc_per_node=1, nnodes=2, endpoint="127.0.0.1:1234",
                           run_id="job", local_addr="127.0.0.1")
    assert "--standalone" not in two
    assert {"--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:1234", "--rdzv-id=job",
            "--local-addr=127.0.0.1"} <= set(two)
    assert shell_line(one).startswith(
        "torchrun --standalone --nproc-per-node=4 -m dpcourse.runtime.cluster m:f")
    assert 0 < free_port() < 65536
    lines = cluster_command_lines()
    assert all(line.startswith("torchrun ") for line in lines.values())
    script = slurm_script()
    assert script.startswith("#!/bin/bash") and "srun torchrun" in script and "$SLURM_JOB_ID" in script


def test_parse_args_defaults():
    args = parse_args(["my:fn", "--checkpoint-dir", "c"])
    assert (args.target, args.samples, args.global_batch, args.dtype) == ("my:fn", 512, 32, "float32")


def test_the_torchrun_driver_picks_its_backend_by_the_course_rule(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("DPCOURSE_BACKEND", "gloo")
    assert pick_backend() == "gloo" and pick_backend("gloo") == "gloo"
    monkeypatch.delenv("DPCOURSE_BACKEND")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert pick_backend() == ("nccl" if gpus >= 2 and torch.distributed.is_nccl_available() else "gloo")
    if gpus < 2:
        with pytest.raises(ValueError, match="one GPU per rank"):
            pick_backend("nccl")


def exported_example(a, b=2):
    """A function to export."""
    return dist.get_world_size() + a + b  # noqa: F821 - resolved in the exported module


def test_export_function_writes_an_importable_module(tmp_path, monkeypatch):
    path = export_function(exported_example, tmp_path, module="exported_mod")
    assert path.endswith("exported_mod.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    import exported_mod

    assert exported_mod.exported_example.__doc__ == "A function to export."
    assert hasattr(exported_mod, "DistributedSampler") and hasattr(exported_mod, "rank_device")
