"""Launch latency: launch(fn, N) -> results for a trivial all-reduce, median of 15, N = 1, 2, 4.

The baseline in the same run is the cost of forking N bare Python processes that exit at once,
so the ratio shows what joining a process group and relaying results adds.
"""

import os
import statistics
import time

import torch
import torch.distributed as dist

from dpcourse import launch

REPEATS = 15


def trivial_all_reduce():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def bare_forks(n):
    pids = []
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)


def median_seconds(fn):
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    print(f"{'N':>3} {'launch median':>14} {'bare fork+wait':>15} {'ratio':>7}")
    for n in (1, 2, 4):
        launched = median_seconds(lambda n=n: launch(trivial_all_reduce, n))
        baseline = median_seconds(lambda n=n: bare_forks(n))
        print(f"{n:>3} {launched * 1e3:>11.1f} ms {baseline * 1e3:>12.2f} ms {launched / baseline:>6.0f}x")


if __name__ == "__main__":
    main()
