"""dpcourse.toys.data: generated data sets and small models are reproducible and leave global RNG alone."""

import torch
from torch import nn

from dpcourse.toys.data import gradient_problems, line_data, regression_data, spiral_data
from dpcourse.toys.models import RecordingLoss, linear, mlp


def test_generators_are_deterministic_and_shaped():
    state = torch.random.get_rng_state()
    x1, y1 = line_data(16, seed=3)
    x2, y2 = line_data(16, seed=3)
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and x1.shape == (16, 1) == y1.shape
    assert not torch.equal(line_data(16, seed=4)[0], x1)
    x, y = regression_data(9, features=3, outputs=2, seed=1)
    assert x.shape == (9, 3) and y.shape == (9, 2)
    x, y = spiral_data(30, classes=3, seed=0)
    assert x.shape == (30, 2) and y.dtype == torch.long and set(y.tolist()) == {0, 1, 2}
    assert torch.equal(torch.random.get_rng_state(), state), "generators must not touch the global RNG"


def test_models_are_seeded_and_optional_layers_appear():
    a, b = mlp(4, 8, 2, seed=5), mlp(4, 8, 2, seed=5)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert any(isinstance(m, nn.BatchNorm1d) for m in mlp(batchnorm=True).modules())
    assert any(isinstance(m, nn.Dropout) for m in mlp(dropout=0.5).modules())
    assert linear(3, 2, seed=0).weight.shape == (2, 3)


def test_gradient_problems_have_no_batch_dependent_layers():
    for name, model, loss_fn, x, y in gradient_problems(0):
        assert not any(isinstance(m, (nn.BatchNorm1d, nn.Dropout)) for m in model.modules()), name
        assert torch.isfinite(loss_fn(model(x), y)), name


def test_recording_loss_remembers_batch_sizes():
    loss = RecordingLoss(nn.MSELoss())
    loss(torch.zeros(3, 1), torch.zeros(3, 1))
    loss(torch.zeros(5, 1), torch.ones(5, 1))
    assert loss.sizes == [3, 5]
