"""dpcourse.reference.gradients: float64 single-process references agree with PyTorch's own computations."""

import torch
from torch import nn

from dpcourse.reference.gradients import batch_norm, full_batch_gradient, parameter_names, sgd_steps
from dpcourse.toys.data import spiral_data
from dpcourse.toys.models import mlp
from markers import exercise


@exercise("data_parallel_gradient")
def test_full_batch_gradient_is_float64_and_leaves_the_model_alone():
    model, (x, y) = mlp(2, 8, 3, seed=0), spiral_data(12, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    grads = full_batch_gradient(model, nn.CrossEntropyLoss(), x, y)
    expected = torch.autograd.grad(nn.CrossEntropyLoss()(model(x), y), list(model.parameters()))
    for g, e in zip(grads, expected, strict=True):
        assert g.dtype == torch.float64 and torch.allclose(g.float(), e, atol=1e-6)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(p.grad is None for p in model.parameters())


@exercise("simulated_dp_step", "allreduce_sgd_step")
def test_sgd_steps_matches_torch_optim_sgd():
    model, (x, y) = mlp(2, 8, 3, seed=1), spiral_data(10, seed=1)
    expected = sgd_steps(model, nn.CrossEntropyLoss(), x, y, lr=0.3, steps=3)
    model = model.double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    for _ in range(3):
        optimizer.zero_grad()
        nn.CrossEntropyLoss()(model(x.double()), y).backward()
        optimizer.step()
    for p, e in zip(model.parameters(), expected, strict=True):
        assert torch.allclose(p, e, atol=1e-12)


@exercise("sync_batch_norm")
def test_batch_norm_matches_functional_batch_norm_in_training_mode():
    x = torch.randn(7, 3) * 4 + 2
    weight, bias = torch.tensor([1.0, 0.5, 2.0]), torch.tensor([0.0, 1.0, -1.0])
    expected = nn.functional.batch_norm(x.double(), None, None, weight.double(), bias.double(),
                                        training=True)
    assert torch.allclose(batch_norm(x, weight, bias), expected, atol=1e-12)


def test_parameter_names_follow_parameters_order():
    assert parameter_names(mlp(2, 4, 1)) == ["0.weight", "0.bias", "2.weight", "2.bias"]
