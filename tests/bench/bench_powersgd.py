"""PowerSGD step time: the instructor's hook against torch's powerSGD_hook, same model, same run.

Same model (an MLP of 6 layers 1024 wide, float32: 6.3 M parameters, 25 MB of gradients), same data (32
samples per rank), rank 4, N = 2 and 4 ranks (gloo on the CPU, NCCL with one GPU per rank), every
gradient in one DDP bucket (dpcourse.topics.compression.bench explains why: torch's hook can issue the
ranks' collectives in different orders with several buckets on gloo). Variants: DDP without a hook,
autograder/dpgrader/less_communication/tuned.py (the exercise's contract), and torch's powerSGD_hook
configured alike (compressing from step 2, min_compression_rate=1, error feedback, warm start). They run
interleaved in one launch (round-robin, the order rotated every round, a barrier before every step), 3
steps per variant and round; the first round is warm-up. Ratios are the median over rounds of
per-round ratios of median step times. The target: the tuned hook within 1.1x of torch's step time.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "autograder"))

from dpcourse.topics.compression.bench import compare_hooks  # noqa: E402
from dpcourse.toys.bench import print_ratios  # noqa: E402
from dpgrader.less_communication.tuned import TunedPowerSGDState, tuned_powersgd_hook  # noqa: E402

DEPTH, WIDTH, PER_RANK, RANK = 6, 1024, 32, 4
TARGET = 1.1
TUNED = "tuned powersgd_hook"


def main():
    medians, ratios, start = {}, {}, time.perf_counter()
    for world_size in (2, 4):
        medians[world_size], ratios[world_size] = compare_hooks(
            {TUNED: (tuned_powersgd_hook, TunedPowerSGDState)}, world_size, matrix_rank=RANK, depth=DEPTH,
            width=WIDTH, per_rank=PER_RANK, steps=3, rounds=8, deadline=300)
    print(f"MLP {DEPTH} x {WIDTH} (float32), {PER_RANK} samples per rank, PowerSGD rank {RANK}, one bucket")
    print_ratios(medians, "torch powerSGD_hook", ratios)
    for world_size in medians:
        ratio = ratios[world_size][TUNED]
        verdict = "within" if ratio <= TARGET else "ABOVE"
        print(f"N={world_size}: tuned / torch powerSGD_hook = {ratio:.3f} paired: {verdict} the {TARGET}x "
              f"target")
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
