"""A scaling study: DDP throughput against world size, measured here and modelled for GPUs.

Used by notebook 06 (the scaling study and its model).

Weak scaling, the way data-parallel jobs grow: each rank keeps its batch (32
images per GPU in the seeds' ResNet), so N ranks process N times the samples
per step if communication were free. Then

    efficiency(N) = throughput(N) / (N * throughput(1))

is 1 for perfect scaling. On a laptop the ranks share a few cores, so beyond
the core count the efficiency must fall like cores / N; on a GPU machine each
rank has its own GPU, and what is left is communication that backward does not
hide. `predicted_efficiency` is that second story as a formula (ring all-reduce
time from the gradient size and the bus bandwidth), to set against the
measurement.
"""

import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dpcourse.backend import rank_device
from dpcourse.comm.volume import predicted_time
from dpcourse.reference.splits import ceil_div
from dpcourse.runtime.launcher import launch


def ddp_steps_per_second(per_rank_batch=16, steps=8, warmup=2, width=8, size=12):
    """Run in each rank: time `steps` DDP training steps of SmallCNN; return seconds taken.

    Synthetic data is enough here (the sampler costs nothing next to a step); the
    ranks start and stop the clock together, at barriers.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dpcourse.toys.smallcnn import SmallCNN

    device = rank_device()
    torch.manual_seed(0)
    model = SmallCNN(width=width).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(per_rank_batch, 1, size, size, device=device)
    y = torch.randint(4, (per_rank_batch,), device=device)
    for step in range(warmup + steps):
        if step == warmup:
            dist.barrier()
            start = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    return time.perf_counter() - start


def scaling_study(world_sizes=(1, 2, 4), per_rank_batch=16, steps=8, repeats=1, progress=True):
    """Throughput (samples/s of the whole job) for each world size; the best of `repeats` runs."""
    from tqdm import tqdm  # text on stdout: nbgrader scores a cell writing to stderr 0

    throughput = {}
    runs = [(n, r) for r in range(repeats) for n in world_sizes]
    for n, _ in tqdm(runs, desc="world sizes", file=sys.stdout, disable=not progress):
        seconds = max(launch(ddp_steps_per_second, n, per_rank_batch, steps))
        throughput[n] = max(throughput.get(n, 0.0), n * per_rank_batch * steps / seconds)
    return throughput


def efficiency(throughput):
    """throughput(N) / (N * throughput(1)) for each N measured (needs N = 1)."""
    if 1 not in throughput:
        raise ValueError("efficiency needs the throughput of 1 rank")
    return {n: t / (n * throughput[1]) for n, t in throughput.items()}


def ring_all_reduce_seconds(nbytes, world_size, bus_bandwidth, latency=0.0, buckets=1):
    """A ring all-reduce sends 2 (N-1)/N of the buffer per rank, in 2 (N-1) steps per bucket."""
    return buckets * predicted_time("ring", nbytes / buckets, world_size, latency, bus_bandwidth)


def predicted_efficiency(world_sizes, compute_seconds, gradient_bytes, inter_bandwidth,
                         intra_bandwidth=100e9, gpus_per_server=8, latency=10e-6, bucket_bytes=25e6,
                         overlap=0.5):
    """A model of a GPU cluster, not a measurement: efficiency = compute / (compute + exposed comm).

    Up to `gpus_per_server` ranks talk over NVLink (`intra_bandwidth`, bytes/s);
    beyond, the ring crosses servers and runs at the slower `inter_bandwidth`.
    Gradients go in DDP's 25 MB buckets, each ring step costs `latency`, and
    backward hides the fraction `overlap` of the communication.
    """
    buckets = max(1, ceil_div(int(gradient_bytes), int(bucket_bytes)))
    result = {}
    for n in world_sizes:
        bandwidth = intra_bandwidth if n <= gpus_per_server else inter_bandwidth
        comm = ring_all_reduce_seconds(gradient_bytes, n, bandwidth, latency, buckets)
        result[n] = compute_seconds / (compute_seconds + (1 - overlap) * comm)
    return result


# The GPU picture: ResNet-50, 32 images per GPU (the seeds' 256 over 8 GPUs). Orders of magnitude:
# ~0.1 s of forward+backward per step on a V100 in float32, 25.6 M float32 gradients (102 MB).
RESNET50 = dict(compute_seconds=0.10, gradient_bytes=25.6e6 * 4)


LINKS = {  # bus bandwidth an all-reduce reaches between servers, bytes/s (orders of magnitude)
    "8-GPU servers, InfiniBand 4x100 Gb/s (~40 GB/s)": 40e9,
    "8-GPU servers, 25 Gb Ethernet (~2.5 GB/s)": 2.5e9,
    "8-GPU servers, 10 Gb Ethernet (~1 GB/s)": 1e9,
}


def plot_scaling(throughput, gpu_world_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256), overlap=0.5,
                 cores=None):
    """Left: measured throughput, the ideal line and the ideal capped by this machine's cores.
    Right: measured efficiency, and the model's efficiency for ResNet-50 over three kinds of links."""
    import os

    import matplotlib.pyplot as plt

    cores = cores or os.cpu_count() or 1
    sizes = sorted(throughput)
    eff = efficiency(throughput)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.6))
    left.plot(sizes, [throughput[n] for n in sizes], "o-", label="measured (DDP, gloo)")
    left.plot(sizes, [n * throughput[1] for n in sizes], "--", color="grey", label="ideal: N x 1 rank")
    left.plot(sizes, [min(n, cores) * throughput[1] for n in sizes], ":", color="black",
              label=f"ideal on {cores} cores: min(N, {cores}) x 1 rank")
    left.set(xlabel="ranks N", ylabel="samples / s (whole job)", xticks=sizes,
             title="throughput on this machine")
    left.legend(fontsize=8)
    right.plot(sizes, [eff[n] for n in sizes], "o-", label="measured here")
    right.plot(sizes, [min(n, cores) / n for n in sizes], ":", color="black",
               label=f"cap on {cores} cores: min(N, {cores}) / N")
    for name, bandwidth in LINKS.items():
        model = predicted_efficiency(gpu_world_sizes, inter_bandwidth=bandwidth, overlap=overlap,
                                     **RESNET50)
        right.plot(list(model), list(model.values()), ".--", label=f"model: {name}")
    right.set_xscale("log", base=2)
    right.set_xticks(list(gpu_world_sizes), [str(n) for n in gpu_world_sizes])
    right.set(ylim=(0, 1.05), xlabel="ranks N (GPUs for the model curves)", ylabel="efficiency",
              title=f"efficiency; model: ResNet-50, {overlap:.0%} overlap")
    right.legend(fontsize=7)
    fig.tight_layout()
    plt.show()
    return fig
