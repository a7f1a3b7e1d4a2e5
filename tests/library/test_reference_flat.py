"""reference.flat: the single-process run as ZeRO sees it, one flat vector, against torch's own optimizer."""

import torch

from dpcourse.reference.flat import adamw, element_name, flat, single_process_run, trainable
from dpcourse.reference.gradients import single_process_gradients
from dpcourse.reference.training import train_single_process
from dpcourse.toys.data import global_batch, smooth_regression_data
from dpcourse.toys.models import deep_mlp, frozen_first_layer
from markers import exercise

pytestmark = exercise("sharded_optimizer", "reduce_scatter_gradients", "mini_fsdp")


def test_a_run_matches_torch_step_by_step():
    X, Y = smooth_regression_data(3 * 8, seed=3)
    run = single_process_run(lambda: deep_mlp(seed=2), X, Y, steps=3, global_size=8)
    model = deep_mlp(seed=2)
    assert torch.equal(run["start"], flat(model.parameters()))
    grads = single_process_gradients(model, *global_batch(X, Y, 0, 8))
    assert torch.equal(run["grads"][0], flat(grads.values()))
    trained = train_single_process(deep_mlp(seed=2), X, Y, 3, 8, make_optimizer=adamw)
    assert torch.equal(run["params"], flat(trained.parameters()))
    assert sorted(run["optimizer"]) == ["exp_avg", "exp_avg_sq"]
    assert run["optimizer"]["exp_avg"].numel() == run["params"].numel() == 994
    assert not torch.equal(run["grads"][1], run["grads"][0])


def test_frozen_parameters_are_left_out_of_the_flat_vector():
    X, Y = smooth_regression_data(8, seed=4)
    run = single_process_run(lambda: frozen_first_layer(seed=1), X, Y, steps=1, global_size=8)
    assert [name for name, _ in run["names"]] == ["fc.weight", "fc.bias", "head.weight", "head.bias"]
    assert run["params"].numel() == sum(p.numel() for p in trainable(frozen_first_layer().parameters()))
    assert torch.equal(run["state"]["frozen.weight"], frozen_first_layer(seed=1).frozen.weight)


def test_element_names():
    names = [("fc0.weight", 128), ("fc0.bias", 16)]
    assert element_name(names, 0) == "fc0.weight[0]"
    assert element_name(names, 130) == "fc0.bias[2]"
    assert element_name(names, 144) == "element 144"
