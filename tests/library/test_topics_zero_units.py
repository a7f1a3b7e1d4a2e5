"""topics.zero.units: FlatUnit frees and refills a module's parameters without autograd noticing, and
the recorder's log counts the units that are whole at once."""

import pytest
import torch

from dpcourse.reference.gradients import single_process_gradients
from dpcourse.topics.zero.units import FlatUnit, UnitRecorder, most_unsharded, padded, unsharded_over_time
from dpcourse.toys.data import smooth_regression_data
from dpcourse.toys.models import deep_mlp, frozen_first_layer, loss_fn
from markers import exercise

pytestmark = exercise("mini_fsdp")


def test_a_unit_is_one_flat_leaf_whose_memory_comes_and_goes():
    model = deep_mlp(seed=0)
    weight = model.fc1.weight.detach().clone()
    unit = FlatUnit(model.fc1, "fc1")
    assert unit.numel == 16 * 16 + 16 and unit.unsharded and unit.nbytes == 272 * 8
    assert torch.equal(model.fc1.weight, weight) and model.fc1.weight._base is unit.full
    assert "weight" not in model.fc1._parameters and len(list(model.parameters())) == 8
    values = unit.buffer.clone()
    unit.free()
    assert not unit.unsharded and unit.full.untyped_storage().nbytes() == 0
    unit.alloc().copy_(values)
    assert unit.unsharded and torch.equal(model.fc1.weight, weight)


def test_the_flat_gradient_is_the_modules_gradient_and_its_hook_fires_once():
    X, Y = smooth_regression_data(8, seed=1)
    expected = single_process_gradients(deep_mlp(seed=0), X, Y)
    model = deep_mlp(seed=0)
    units = [FlatUnit(child, name) for name, child in model.named_children() if not name.startswith("act")]
    calls = []
    for unit in units:
        unit.full.register_post_accumulate_grad_hook(lambda full, unit=unit: calls.append(unit.name))
        unit.alloc()  # fresh views, as a forward pre-hook would make them
    loss_fn(model(X), Y).backward()
    assert calls == ["head", "fc3", "fc2", "fc1", "fc0"]  # once each, in backward order
    for unit in units:
        names = [f"{unit.name}.weight", f"{unit.name}.bias"]
        assert torch.allclose(unit.full.grad, torch.cat([expected[n].reshape(-1) for n in names]), atol=1e-12)


def test_a_freed_unit_cannot_be_used_in_backward():
    X, Y = smooth_regression_data(4, seed=2)
    model = deep_mlp(seed=0)
    unit = FlatUnit(model.fc2, "fc2")
    loss = loss_fn(model(X), Y)
    unit.free()
    with pytest.raises(RuntimeError, match="out of bounds for storage of size 0"):
        loss.backward()


def test_frozen_parameters_stay_and_a_unit_needs_a_trainable_one():
    model = frozen_first_layer(seed=0)
    with pytest.raises(ValueError, match="no trainable parameters"):
        FlatUnit(model.frozen, "frozen")
    unit = FlatUnit(model, "all")
    assert unit.numel == 16 * 16 + 16 + 16 * 2 + 2
    assert [name for name, _ in model.named_parameters()] == ["frozen.weight", "frozen.bias"]


def test_the_log_counts_units_whole_at_once_after_the_first_mark():
    model = deep_mlp(seed=0)
    with UnitRecorder() as log:
        units = [FlatUnit(model.fc0, "fc0"), FlatUnit(model.fc1, "fc1")]  # created whole: not counted
        for unit in units:
            unit.free()
        log.mark("built")
        units[0].alloc()
        units[1].alloc()
        units[0].free()
        units[1].free()
    assert [e[:2] for e in log.events][:2] == [("create", "fc0"), ("create", "fc1")]
    assert most_unsharded(log.events) == (2, ["fc0", "fc1"], ("alloc", "fc1", False))
    assert unsharded_over_time(log.events)[-1] == (("free", "fc1", False), [])
    assert FlatUnit(model.head, "head") and len(log.events) == 9  # the recorder is closed


@exercise("sharded_optimizer", "reduce_scatter_gradients")
def test_padded():
    assert padded(torch.tensor([1.0, 2.0]), 4).tolist() == [1.0, 2.0, 0.0, 0.0]
