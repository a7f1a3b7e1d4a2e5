"""dpcourse.topics.data_parallel.replicas:
CPU devices share the module; real GPUs use torch.nn.parallel.replicate.
"""

import pytest
import torch
from torch import nn

from dpcourse.topics.data_parallel import replicas as dp_replicas
from dpcourse.topics.data_parallel.replicas import cpu_devices, demo_devices, gpu_devices, replicate
from dpcourse.toys.models import mlp
from markers import exercise

pytestmark = exercise("mini_data_parallel")

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2


@exercise("scatter")
def test_cpu_devices_and_shared_replicas():
    devices = cpu_devices(3)
    assert devices == [torch.device("cpu")] * 3
    model = mlp(2, 4, 1)
    assert all(r is model for r in replicate(model, devices))
    with pytest.raises(ValueError):
        cpu_devices(0)
    with pytest.raises(ValueError):
        replicate(model, [])


def test_gradients_of_shared_replicas_add_up_like_the_whole_batch():
    model, x = mlp(2, 4, 1, seed=1), torch.randn(6, 2)
    whole = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    a, b = replicate(model, cpu_devices(2))
    parts = torch.autograd.grad(a(x[:4]).sum() + b(x[4:]).sum(), list(model.parameters()))
    assert all(torch.allclose(w, p, atol=1e-6) for w, p in zip(whole, parts, strict=True))


def test_replicate_reports_its_time_to_observers():
    spans = []
    dp_replicas.observers.append(lambda s, e: spans.append((s, e)))
    try:
        replicate(nn.Linear(1, 1), cpu_devices(2))
    finally:
        dp_replicas.observers.clear()
    assert len(spans) == 1 and spans[0][0] <= spans[0][1]


def test_demo_devices_fall_back_to_cpu():
    if len(gpu_devices()) < 4:
        assert demo_devices(4) == cpu_devices(4)


@pytest.mark.skipif(not TWO_GPUS, reason="needs 2 GPUs: torch.nn.parallel.replicate on real devices")
def test_replicate_on_two_gpus_copies_and_reduces_gradients():
    devices = gpu_devices()[:2]
    model = mlp(2, 4, 1, seed=2).to(devices[0])
    replicas = replicate(model, devices)
    assert [next(r.parameters()).device for r in replicas] == devices
    x = torch.randn(6, 2)
    out = replicas[0](x[:3].to(devices[0])).sum() + replicas[1](x[3:].to(devices[1])).sum().to(devices[0])
    out.backward()
    expected = torch.autograd.grad(model(x.to(devices[0])).sum(), list(model.parameters()))
    for p, e in zip(model.parameters(), expected, strict=True):
        assert torch.allclose(p.grad, e, atol=1e-5)
