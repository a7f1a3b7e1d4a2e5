"""Which backend a launch uses and which device a rank's tensors belong on.

One rule for the whole course (launch, the torchrun driver, the notebooks): NCCL with one
GPU per rank when the machine has enough GPUs, gloo on the CPU otherwise; DPCOURSE_BACKEND
forces one. Used by every notebook through `launch` and `rank_device`.
"""

import os

import torch
import torch.distributed as dist


def rank_device():
    """The device this rank's tensors belong on: its own GPU under NCCL, else the CPU.

    Call it inside a launched function; tests and exercises use it so the same code
    runs with gloo on a laptop and with NCCL on a multi-GPU machine.
    """
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_backend(world_size, backend=None):
    """Pick gloo or NCCL; refuse NCCL when there is not one GPU per rank."""
    backend = (backend or os.environ.get("DPCOURSE_BACKEND") or "auto").lower()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        enough = gpus >= world_size and dist.is_nccl_available()
        return "nccl" if enough else "gloo"
    if backend == "nccl" and (gpus < world_size or not dist.is_nccl_available()):
        raise ValueError(f"the NCCL backend needs one GPU per rank: {world_size} ranks asked, "
                         f"torch sees {gpus} GPU(s){'' if dist.is_nccl_available() else ' and no NCCL'}."
                         " Use backend='gloo' (or unset DPCOURSE_BACKEND) to run on the CPU.")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"unknown backend {backend!r}: use 'gloo', 'nccl' or 'auto'")
    return backend
