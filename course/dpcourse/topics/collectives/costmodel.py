"""The alpha-beta cost model of an all-reduce, and how to measure the real thing against it.

Used by notebook 04 (ping-pong, the alpha-beta fit, bandwidth tables and plots). The model itself --
messages, bytes and time of each algorithm -- is dpcourse.comm.volume's (`messages_and_bytes`,
`predicted_time`), which notebooks 05, 06 and 09 price with too.

A message of n bytes costs  t = alpha + n / beta:  alpha is the latency of one message
(microseconds on a network, tens of microseconds through gloo), beta the bandwidth in
bytes per second. An all-reduce of S bytes on N ranks then costs, for the busiest rank:

    naive  (gather to a root, add, send back)   2(N-1) messages of S         2(N-1)·(alpha + S/beta)
    tree   (binomial reduce, then broadcast)    2·ceil(log2 N) messages of S 2·ceil(log2 N)·(alpha + S/beta)
    ring   (reduce-scatter, then all-gather)    2(N-1) messages of S/N       2(N-1)·(alpha + S/(N·beta))

The ring's bandwidth term, 2(N-1)/N · S/beta, barely grows with N: that is why it is
bandwidth-optimal, and why NCCL and Horovod use it for large tensors (trees win on latency,
for small ones).

Measured speed is reported as NCCL-tests do: algbw = S / time, and busbw = algbw · 2(N-1)/N,
the rate at which each rank's link actually moved bytes -- comparable across N, and with
the link bandwidth.
"""

import statistics
import time

import torch
import torch.distributed as dist

from dpcourse.backend import rank_device
from dpcourse.comm.volume import ALGORITHMS, predicted_time, ring_traffic
from dpcourse.viz.tables import format_bytes


def algbw(nbytes, seconds):
    """Algorithm bandwidth (bytes/s): the tensor size over the time the all-reduce took."""
    return nbytes / seconds


def busbw(nbytes, seconds, world_size):
    """Bus bandwidth (bytes/s) of an all-reduce, NCCL-tests' convention: algbw · 2(N-1)/N (what a rank
    of a ring sends, per byte of the tensor)."""
    return ring_traffic(algbw(nbytes, seconds), world_size)[1]


def fit_alpha_beta(sizes, seconds):
    """Least-squares fit of t = alpha + n/beta to one-way message times; returns (alpha, beta)."""
    n = len(sizes)
    mean_x, mean_y = sum(sizes) / n, sum(seconds) / n
    sxx = sum((x - mean_x) ** 2 for x in sizes)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, seconds, strict=True)) / sxx
    alpha = max(mean_y - slope * mean_x, 0.0)
    return alpha, (1.0 / slope if slope > 0 else float("inf"))


def ping_pong(sizes, repeats=5):
    """Runs on every rank: ranks 0 and 1 bounce a message of each size; one-way time = round trip / 2.

    Returns {nbytes: median one-way seconds} (on every rank). Other ranks only wait.
    """
    rank = dist.get_rank()
    out = {}
    for nbytes in sizes:
        buf = torch.zeros(max(1, nbytes // 4), device=rank_device())
        times = []
        for _ in range(repeats + 1):  # the first round trip warms the connection up
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            times.append((time.perf_counter() - start) / 2)
        seconds = torch.tensor([statistics.median(times[1:])], dtype=torch.float64)
        dist.broadcast(seconds, 0)
        out[buf.numel() * 4] = seconds.item()
    return out


def time_all_reduces(fns, sizes, repeats=5, dtype=torch.float32, samples=False):
    """Runs on every rank: time each all-reduce function on each size, interleaved; medians.

    fns: {name: fn(tensor)}, each an in-place sum like dist.all_reduce. Every repeat runs all
    the functions on the same data, one after the other, starting with a different one each
    time (so machine noise and cache effects hit them alike), each after a barrier; a
    repeat's time is the slowest rank's. The result of each call is checked against N·x.
    Returns {name: {nbytes: median seconds}}, or with samples=True {name: {nbytes: [seconds
    of each repeat]}} (repeat i of every function ran back to back: ratios can be paired).
    """
    world = dist.get_world_size()
    element = torch.empty((), dtype=dtype).element_size()
    names = list(fns)
    out = {name: {} for name in fns}
    for nbytes in sizes:
        numel = max(1, nbytes // element)
        source = torch.ones(numel, dtype=dtype, device=rank_device())
        tensor = source.clone()
        times = {name: [] for name in fns}
        for repeat in range(repeats + 1):  # round 0 warms up buffers and connections
            for k in range(len(names)):
                name = names[(repeat + k) % len(names)]
                tensor.copy_(source)
                dist.barrier()
                start = time.perf_counter()
                fns[name](tensor)
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times[name].append(elapsed.item())
                if tensor[0].item() != world or tensor[-1].item() != world:
                    raise AssertionError(f"{name} returned a wrong sum on {numel} elements: "
                                         f"{tensor[0].item()} … {tensor[-1].item()}, expected {world}")
        for name in fns:
            kept = times[name][1:]
            out[name][numel * element] = kept if samples else statistics.median(kept)
    return out


def bandwidth_rows(timings, world_size):
    """[(name, nbytes, seconds, algbw GB/s, busbw GB/s)] from time_all_reduces' result."""
    rows = []
    for name, per_size in timings.items():
        for nbytes, seconds in sorted(per_size.items()):
            rows.append((name, nbytes, seconds, algbw(nbytes, seconds) / 1e9,
                         busbw(nbytes, seconds, world_size) / 1e9))
    return rows


def print_bandwidth(timings, world_size, baseline=None):
    """A table of time, algbw and busbw per function and size; ratios of busbw to `baseline`."""
    print(f"N = {world_size}")
    header = f"{'size':>9} {'function':>16} {'time':>10} {'algbw':>11} {'busbw':>11}"
    print(header + (f" {'busbw / ' + baseline:>20}" if baseline else ""))
    for name, nbytes, seconds, alg, bus in sorted(bandwidth_rows(timings, world_size),
                                                  key=lambda row: row[1]):
        line = (f"{format_bytes(nbytes):>9} {name:>16} {seconds * 1e3:>7.2f} ms "
                f"{alg:>6.2f} GB/s {bus:>6.2f} GB/s")
        if baseline:
            line += f" {timings[baseline][nbytes] / seconds:>19.2f}x"
        print(line)


def plot_bandwidth(timings_by_n, title="all-reduce bus bandwidth", ax=None):
    """busbw against size, one line per function and world size ({N: time_all_reduces result})."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    styles = ["-", "--", ":", "-."]
    for i, (n, timings) in enumerate(sorted(timings_by_n.items())):
        for j, (name, per_size) in enumerate(timings.items()):
            sizes = sorted(per_size)
            ax.plot(sizes, [busbw(s, per_size[s], n) / 1e9 for s in sizes], styles[i % 4], marker="o",
                    color=plt.get_cmap("tab10")(j), label=f"{name}, N={n}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tensor size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return ax


def plot_model(nbytes, alpha, beta, world_sizes=(2, 4, 8, 16, 32, 64, 128, 256), ax=None):
    """Predicted all-reduce time of each algorithm against N, for one tensor size."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    for algorithm in ALGORITHMS:
        ax.plot(world_sizes, [predicted_time(algorithm, nbytes, n, alpha, beta) * 1e3 for n in world_sizes],
                marker="o", label=algorithm)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks N")
    ax.set_ylabel("predicted time (ms)")
    ax.set_title(f"all-reduce of {nbytes / 1e6:.3g} MB: alpha = {alpha * 1e6:.0f} µs, "
                 f"beta = {beta / 1e9:.1f} GB/s", fontsize=10)
    ax.legend()
    ax.grid(alpha=0.3, which="both")
    return ax
