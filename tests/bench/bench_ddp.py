"""DDP step time: naive, the reference bucketed + overlapped DDP, and torch's DistributedDataParallel.

Same model (an 8-layer MLP, 1024 wide, float32: 8.4 M parameters = 33.6 MB of gradients), same data,
same bucket cap for the two bucketed versions, N = 2 and 4 ranks (gloo on the CPU, NCCL with one GPU
per rank). The three run interleaved in one launch (round-robin, order rotated every round, a barrier
before every step), 4 steps per variant and round; the first round is warm-up. The table shows median
step times and, as the ratio to torch DDP, the median over rounds of per-round ratios (pairing each
round with itself cancels the drift of a shared machine; the plain ratio of medians is printed too).
The target: the reference (autograder/dpgrader/ddp_from_scratch/tuned.py, the solution of notebook 05's
BucketedDDP) within 1.05x of torch DDP's step time.
"""

import sys
import time
from pathlib import Path

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "autograder"))

from dpcourse.toys.bench import compare_step_times, print_ratios  # noqa: E402
from dpgrader.ddp_from_scratch.tuned import ReferenceDDP  # noqa: E402

DEPTH, WIDTH, PER_RANK = 8, 1024, 64
BUCKET_MB = 8
TARGET = 1.05


def naive(module):
    def sync():
        world_size = dist.get_world_size()
        for p in module.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world_size
    return module, sync


def reference(module):
    ddp = ReferenceDDP(module, bucket_cap=BUCKET_MB * 2 ** 20)
    return ddp, ddp.finish_gradient_sync


def torch_ddp(module):
    return DistributedDataParallel(module, bucket_cap_mb=BUCKET_MB), None


def main():
    variants = {"naive": naive, "reference bucketed": reference, "torch DDP": torch_ddp}
    medians, ratios, start = {}, {}, time.perf_counter()
    for world_size in (2, 4):
        medians[world_size], ratios[world_size] = compare_step_times(
            variants, world_size, baseline="torch DDP", depth=DEPTH, width=WIDTH, per_rank=PER_RANK,
            steps=4, rounds=10, deadline=240)
    print(f"MLP {DEPTH} x {WIDTH} (float32), {PER_RANK} samples per rank, buckets of {BUCKET_MB} MiB")
    print_ratios(medians, "torch DDP", ratios)
    for world_size in medians:
        ratio = ratios[world_size]["reference bucketed"]
        plain = medians[world_size]["reference bucketed"] / medians[world_size]["torch DDP"]
        verdict = "within" if ratio <= TARGET else "ABOVE"
        print(f"N={world_size}: reference / torch DDP = {ratio:.3f} paired ({plain:.3f} as a ratio of "
              f"medians): {verdict} the {TARGET}x target")
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
