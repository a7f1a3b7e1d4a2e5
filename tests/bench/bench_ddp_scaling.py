"""DDP weak scaling on this machine: SmallCNN training steps at N = 1, 2, 4 ranks (notebook 06).

Each rank keeps its batch (64 images); throughput is samples/s of the whole job. The baseline is
N = 1 measured in the same run, interleaved with the others (rounds of 1, 2, 4), medians of the
rounds. Efficiency = throughput(N) / (N * throughput(1)); on a machine with C cores it is capped at
min(N, C) / N. Also printed: what DDP's lazy import of torch._dynamo costs a launch when the
parent has not imported it first (dpcourse.ddp_warmup), the reason notebook 06 warms up.
"""

import os
import statistics
import subprocess
import sys
import time

from dpcourse import launch
from dpcourse.ddp_warmup import warm_up
from dpcourse.scaling import ddp_steps_per_second

ROUNDS, WORLD_SIZES, BATCH, STEPS = 5, (1, 2, 4), 64, 10

COLD = """
import time
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from dpcourse import launch
def wrap():
    DDP(nn.Linear(2, 2))
start = time.perf_counter()
launch(wrap, 2)
print(time.perf_counter() - start)
"""


def main():
    warm_up()
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
    cold = float(subprocess.run([sys.executable, "-c", COLD], capture_output=True, text=True,
                                check=True).stdout.split()[-1])
    start = time.perf_counter()
    launch(ddp_steps_per_second, 2, 1, 1, 0)
    warm = time.perf_counter() - start
    print(f"first DDP launch of 2 ranks: {cold:.2f} s without warm_up(), {warm:.2f} s with it "
          f"({cold / warm:.0f}x)")


if __name__ == "__main__":
    main()
