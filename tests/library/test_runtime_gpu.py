"""The GPU path of the launcher: NCCL with one GPU per rank, never fork once CUDA is in use.

These run only where torch sees a GPU (skipped on CPU machines, and never counted there).
"""

import pytest
import torch
import torch.distributed as dist

from dpcourse import launch, rank_device

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("no_orphans")]


def on_my_gpu():
    device = rank_device()
    t = torch.full((4,), float(dist.get_rank() + 1), device=device)
    dist.all_reduce(t)
    return dist.get_backend(), device.index, t


def test_auto_backend_uses_nccl_with_one_gpu_per_rank():
    n = torch.cuda.device_count()
    results = launch(on_my_gpu, n)
    for rank, (backend, index, t) in enumerate(results):
        assert backend == "nccl" and index == rank
        assert torch.equal(t, torch.full((4,), n * (n + 1) / 2))


def cpu_sum():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def test_a_parent_that_initialised_cuda_still_launches_gloo_ranks():
    torch.zeros(1, device="cuda")  # CUDA is now initialised here: forking would break it
    n = torch.cuda.device_count() + 1  # more ranks than GPUs: gloo on the CPU
    assert launch(cpu_sum, n) == [float(n)] * n
