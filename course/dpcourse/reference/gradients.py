"""Single-process float64 references: what data-parallel code must reproduce.

Used by notebooks 01 (float64 gradients, sgd_steps, batch_norm) and 05 (single_process_gradients,
state_of), and by their hidden checks.

A test of data-parallel code needs an answer it did not compute itself. The
answer here is the plain, one-worker computation on the whole batch, in float64
so that its own rounding is far below the float32 tolerance of the check. None
of this shards anything: it is the definition data parallelism must match.
"""

import copy

import torch

from dpcourse.reference.training import train_steps
from dpcourse.toys.models import loss_fn


def gradients_of(model):
    """{name: gradient on the CPU, or None} for every parameter."""
    return {name: None if p.grad is None else p.grad.detach().cpu().clone()
            for name, p in model.named_parameters()}


def single_process_gradients(model, x, y):
    """The gradients of loss_fn(model(x), y) in one process (the model is left unchanged)."""
    model.zero_grad(set_to_none=True)
    loss_fn(model(x), y).backward()
    grads = gradients_of(model)
    model.zero_grad(set_to_none=True)
    return grads


def state_of(model):
    """{name: tensor} of every parameter and buffer, detached, on the CPU: what checks compare."""
    state = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
    state.update({name: b.detach().cpu().clone() for name, b in model.named_buffers()})
    return state


def as_float64(model):
    """A float64 copy of `model` on the CPU (the original is untouched)."""
    return copy.deepcopy(model).to("cpu", torch.float64)


def _target(y):
    return y.cpu().double() if y.is_floating_point() else y.cpu()


def full_batch_gradient(model, loss_fn, x, y):
    """The gradient of loss_fn(model(x), y) over the whole batch, in float64, one tensor per parameter."""
    ref = as_float64(model)
    loss = loss_fn(ref(x.cpu().double()), _target(y))
    return [g.detach() for g in torch.autograd.grad(loss, list(ref.parameters()))]


def sgd_steps(model, loss_fn, x, y, lr, steps=1):
    """The parameters after `steps` plain SGD steps (p -= lr * grad) on the whole batch, in float64."""
    ref = as_float64(model)
    train_steps(ref, [(x.cpu().double(), _target(y))] * steps, loss_fn, lr)
    return [p.detach() for p in ref.parameters()]


def batch_norm(x, weight, bias, eps=1e-5):
    """Training-mode batch normalisation of the whole batch x (samples, channels), in float64."""
    x = x.cpu().double()
    mean = x.mean(dim=0)
    var = x.var(dim=0, unbiased=False)
    return (x - mean) / torch.sqrt(var + eps) * weight.cpu().double() + bias.cpu().double()


def parameter_names(model):
    """The names of model.parameters(), in order: for messages that say which tensor is wrong."""
    return [name for name, _ in model.named_parameters()]
