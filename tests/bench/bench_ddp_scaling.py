"""DDP weak scaling on this machine: SmallCNN training steps at N = 1, 2, 4 ranks (notebook 06).

Each rank keeps its batch (64 images); throughput is samples/s of the whole job. The baseline is
N = 1 measured in the same run, interleaved with the others (rounds of 1, 2, 4), medians of the
rounds. Efficiency = throughput(N) / (N * throughput(1)); on a machine with C cores it is capped at
min(N, C) / N, printed alongside.
"""

import os
import statistics

from dpcourse import launch
from dpcourse.topics.ddp.scaling import ddp_steps_per_second

ROUNDS, WORLD_SIZES, BATCH, STEPS = 5, (1, 2, 4), 64, 10


def main():
    samples = {n: [] for n in WORLD_SIZES}
    for _ in range(ROUNDS):
        for n in WORLD_SIZES:
            seconds = max(launch(ddp_steps_per_second, n, BATCH, STEPS))
            samples[n].append(n * BATCH * STEPS / seconds)
    throughput = {n: statistics.median(v) for n, v in samples.items()}
    cores = os.cpu_count()
    print(f"{'N':>3} {'samples/s':>10} {'vs N=1':>7} {'efficiency':>11} {'core cap':>9}")
    for n in WORLD_SIZES:
        ratio = throughput[n] / throughput[1]
        print(f"{n:>3} {throughput[n]:>10.0f} {ratio:>6.2f}x {ratio / n:>11.2f} {min(n, cores) / n:>9.2f}")


if __name__ == "__main__":
    main()
