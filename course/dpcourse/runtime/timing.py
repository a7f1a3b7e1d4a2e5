"""Time several implementations of one training step inside a rank, interleaved in one run.

Used by the speed comparisons of notebooks 05 (DDP), 08 (tensor parallelism), 09 (hybrid layouts)
and 10 (ZeRO/FSDP) through dpcourse.topics.{ddp,tensor,hybrid,zero}.bench, and by `make bench`.

Why interleaved: on a shared machine (2 cores, 4 ranks) speed drifts by tens of percent over
seconds. Timing A for a minute and then B for a minute measures the drift; alternating A, B, C,
then B, C, A, ... (the order rotates, so no variant always follows the same one) measures the
implementations. Every step starts after a barrier, so each rank times the same step, and on a
GPU the clock reads after the device has finished.
"""

import time

import torch
import torch.distributed as dist

from dpcourse.backend import rank_device


def _settle(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def interleaved_step_times(steps, rounds=4, repeats=3):
    """{name: [seconds per step]} for steps = {name: a function running one training step}.

    `rounds` rounds of `repeats` steps of every variant, the order rotated each round; the first
    round is a warm-up and is left out.
    """
    device = rank_device()
    times = {name: [] for name in steps}
    names = list(steps)
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            for _ in range(repeats):
                dist.barrier()
                _settle(device)
                start = time.perf_counter()
                steps[name]()
                _settle(device)
                if round_:
                    times[name].append(time.perf_counter() - start)
    return times
