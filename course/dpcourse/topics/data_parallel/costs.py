"""What nn.DataParallel costs: threads under the GIL, bytes through device 0, copies every step.

Three costs made concrete (notebook 02):
  * the GIL: replicas run as Python threads of one process. Time spent in
    Python (module calls, hooks, small ops) is serialised by the GIL; only time
    inside big kernels, which release it, overlaps. `speedup_with_threads`
    measures how much a wrapper gains over the plain module on two kinds of
    model: one dominated by many small ops, one by big matrix products.
  * device 0 does more: every step it scatters the batch, broadcasts the whole
    model, gathers the outputs, computes the loss alone and receives every
    replica's gradients. `dataparallel_traffic` counts those bytes and compares
    them with what one GPU sends in DDP's ring all-reduce.
  * replication every step: the parameters are copied to every device at every
    forward pass, whatever the batch size. `copy_cost` times what that copy
    costs on this machine against one forward and backward pass.
"""

import statistics
import time

import torch
from torch import nn

from dpcourse.comm.volume import ring_traffic
from dpcourse.viz.tables import print_table


def time_call(fn, repeats=5, warmup=1):
    """Median wall-clock seconds of fn() over `repeats` calls, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def many_small_ops_model(depth=30, width=16, seed=0):
    """A deep, narrow MLP: each layer is a tiny kernel, so time goes into Python and dispatch (GIL held)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.Tanh()]
        return nn.Sequential(*layers)


def big_matmul_model(width=768, seed=0):
    """Two wide layers: time goes into matrix products, which release the GIL."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))


def speedup_with_threads(wrap, devices, repeats=5):
    """Forward time of the plain module and through `wrap(module, devices)`, per kind of model.

    Returns {kind: (plain seconds, wrapped seconds)}. Forward passes only, under no_grad: on the
    CPU the backward pass runs in autograd's single CPU thread whatever the wrapper does (on GPUs
    autograd runs one thread per device). Run it with torch.set_num_threads(1), so that the only
    parallelism is the wrapper's threads.
    """
    cases = {
        "many small ops (30 layers of width 16, batch 64)": (many_small_ops_model(), torch.randn(64, 16)),
        "big matmuls (2 layers of width 768, batch 512)": (big_matmul_model(), torch.randn(512, 768)),
    }
    results = {}
    with torch.no_grad():
        for kind, (model, x) in cases.items():
            wrapped = wrap(model, devices)
            results[kind] = (time_call(lambda m=model, inp=x: m(inp), repeats),
                             time_call(lambda w=wrapped, inp=x: w(inp), repeats))
    return results


def parameter_bytes(model):
    """Bytes of every parameter and buffer: what a broadcast of the model moves to one device."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def dataparallel_traffic(model_bytes, input_bytes, output_bytes, devices):
    """Bytes that enter or leave device 0 in one nn.DataParallel step, phase by phase, and what
    one GPU sends in DDP's ring all-reduce of the same gradients.

    input_bytes / output_bytes: of the whole global batch. Returns {phase: bytes}.
    """
    n = devices
    others = (n - 1) / n
    return {
        "scatter: batch pieces leave device 0": others * input_bytes,
        "replicate: model broadcast to the other devices": (n - 1) * model_bytes,
        "gather: outputs come to device 0": others * output_bytes,
        "backward: output gradients scattered back": others * output_bytes,
        "reduce: every replica's gradients summed on device 0": (n - 1) * model_bytes,
        "DDP, for comparison: one GPU sends in a ring all-reduce": ring_traffic(model_bytes, n)[1],
    }


def print_traffic(traffic, title):
    """A table of dataparallel_traffic in MB, with the DataParallel total through device 0."""
    total = sum(nbytes for phase, nbytes in traffic.items() if not phase.startswith("DDP"))
    rows = [*traffic.items(), ("DataParallel, all through device 0", total)]
    print_table([(phase, f"{nbytes / 1e6:,.1f} MB") for phase, nbytes in rows], [("", -58), ("", 12)], title,
                indent="  ")


def copy_cost(model, x, devices):
    """Seconds to copy every parameter (devices - 1) times, and seconds of one forward + backward.

    On one CPU this copy stands in for the broadcast nn.DataParallel does on every step; on GPUs
    the broadcast crosses PCIe or NVLink and costs more.
    """
    params = [*model.parameters(), *model.buffers()]

    def copies():
        for _ in range(devices - 1):
            for p in params:
                p.detach().clone()

    def step():
        model(x).sum().backward()

    return time_call(copies), time_call(step)
