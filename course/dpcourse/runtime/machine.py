"""What this machine offers for distributed training, in one table.

Used by notebook 00 (show_environment).
"""

import os
import platform

import torch
import torch.distributed as dist

from dpcourse.backend import resolve_backend


def environment():
    """The facts a learner (or a bug report) needs: versions, cores, GPUs, backends."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu cores": os.cpu_count(),
        "torch threads": torch.get_num_threads(),
        "cuda available": torch.cuda.is_available(),
        "gpus (torch.cuda.device_count())": gpus,
        "gpu names": [torch.cuda.get_device_name(i) for i in range(gpus)],
        "gloo available": dist.is_gloo_available(),
        "nccl available": dist.is_nccl_available(),
        "backend for 2 ranks": resolve_backend(2),
        "backend for 4 ranks": resolve_backend(4),
    }


def show_environment():
    facts = environment()
    width = max(map(len, facts))
    for key, value in facts.items():
        print(f"{key:<{width}}  {value}")
    return facts
