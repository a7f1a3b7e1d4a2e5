"""Devices and model replicas for a single-process data-parallel module (notebook 02).

`nn.DataParallel` copies the model onto every GPU at every forward pass with
`torch.nn.parallel.replicate`, which broadcasts parameters *with autograd*: in
the backward pass the gradients of all copies flow back and are summed into the
original parameters. That sum is what makes data parallelism work, and it is
exactly what happens when several "replicas" are the same module object: each
replica's backward accumulates into the same `.grad`.

So this course runs a DataParallel-like module on two kinds of devices:
  * CPU "devices" (`cpu_devices(n)`): n labels for the one CPU; the replicas are
    the module itself, shared, and each runs in its own thread. Everything about
    scatter, threads and gather is real; only the copies are not.
  * real GPUs (`gpu_devices()`, when there are at least two): `replicate` calls
    `torch.nn.parallel.replicate`, as nn.DataParallel does.
"""

import time

import torch

# Callbacks f(start, end) told about every `replicate` call: how dp_timeline times it.
observers = []


def cpu_devices(n):
    """n "devices" for the CPU: `[torch.device("cpu")] * n`. Replicas on them share parameters."""
    if n < 1:
        raise ValueError(f"need at least one device, got {n}")
    return [torch.device("cpu")] * n


def gpu_devices():
    """Every CUDA device of this machine, as torch.device objects (an empty list without CUDA)."""
    if not torch.cuda.is_available():
        return []
    return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]


def demo_devices(n):
    """n devices for a demonstration: n GPUs when there are that many, else n CPU devices."""
    gpus = gpu_devices()
    return gpus[:n] if len(gpus) >= n else cpu_devices(n)


def replicate(module, devices):
    """One replica of `module` per device, whose gradients flow back into `module`'s parameters.

    CPU devices: the module itself, once per device (shared parameters, nothing copied).
    CUDA devices: `torch.nn.parallel.replicate(module, devices)`; `module` must already be
    on devices[0], as nn.DataParallel requires. Mixed CPU and CUDA devices are refused.
    """
    start = time.perf_counter()
    devices = [torch.device(d) for d in devices]
    if not devices:
        raise ValueError("replicate needs at least one device")
    kinds = {d.type for d in devices}
    if kinds == {"cpu"}:
        replicas = [module] * len(devices)
    elif kinds == {"cuda"}:
        if len(devices) == 1:
            replicas = [module]
        else:
            from torch.nn.parallel import replicate as torch_replicate

            replicas = torch_replicate(module, devices, detach=not torch.is_grad_enabled())
    else:
        raise ValueError(f"replicate: devices must be all CPU or all CUDA, got {sorted(kinds)}")
    for observe in list(observers):
        observe(start, time.perf_counter())
    return replicas
