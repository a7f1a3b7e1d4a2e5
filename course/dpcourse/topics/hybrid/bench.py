"""Step times of layouts on this machine, interleaved in one launch, and the cost model fitted to it.

    layouts = {"DP 4 x 1": ("dp_tp", (4, 1)), "DP x TP 2 x 2": ("dp_tp", (2, 2)), ...}
    times = time_layouts(layouts, hybrid_dp_tp_step, hybrid_dp_pp_step, rounds=5)   # {name: [seconds]}
    machine = calibrate()          # {"flops": ..., "alpha": ..., "beta": ...} of 4 busy ranks here
    print_predicted_vs_measured(layouts, times, machine)

Why interleaved: on a shared 2-core laptop the speed of the machine drifts during a run. All
layouts are built in the same launch (one init_device_mesh each) and timed round by round in a
rotating order (dpcourse.runtime.timing), each step after a barrier, a step's time being
the slowest rank's; medians and per-round ratios to a baseline are then comparable.
`calibrate` measures what the cost model needs on the same 4 ranks: the FLOP/s of one rank
while all four compute (they share 2 cores), and alpha and beta of gloo's ring all-reduce
(fitted to 2(n - 1)(alpha + S/(n beta)) at two sizes).
Used by notebook 09 (its measured-vs-predicted table) and tests/bench/bench_hybrid.py.
"""

import statistics
import time

import torch
import torch.distributed as dist

from dpcourse.comm.volume import ring_traffic
from dpcourse.runtime.launcher import launch
from dpcourse.runtime.timing import interleaved_step_times
from dpcourse.topics.hybrid.costs import predict
from dpcourse.topics.hybrid.grid import mesh_grid
from dpcourse.topics.hybrid.models import dp_pp_model, dp_tp_model, even_cuts, tensor_parallel_copy
from dpcourse.topics.hybrid.pipeline import gpipe
from dpcourse.toys.clusters import cluster
from dpcourse.toys.models import loss_fn

MLP_MODEL = dict(d_in=64, d_model=256, d_hidden=1024, d_out=64, blocks=4)  # the DP x TP layouts' model
STACK_MODEL = dict(width=384, layers=8)  # the DP x PP layouts' model
ROWS = 128


def _build(kind, grid_shape, dtype):
    dp, other = grid_shape
    if kind == "dp_tp":
        grid, mesh = mesh_grid(dp, tp=other)
        model = tensor_parallel_copy(dp_tp_model(**MLP_MODEL, seed=0, dtype=dtype), mesh["tp"])
        return grid, model, None
    grid, _ = mesh_grid(dp, tp=1, pp=other)
    model = dp_pp_model(**STACK_MODEL, seed=0, dtype=dtype)
    return grid, model, even_cuts(len(model), other)


def _batch(kind, dtype):
    g = torch.Generator().manual_seed(0)
    width_in = MLP_MODEL["d_in"] if kind == "dp_tp" else STACK_MODEL["width"]
    width_out = MLP_MODEL["d_out"] if kind == "dp_tp" else STACK_MODEL["width"]
    return (torch.randn(ROWS, width_in, generator=g, dtype=dtype),
            torch.randn(ROWS, width_out, generator=g, dtype=dtype))


def _timing_side(layouts, dp_tp_step, dp_pp_step, rounds, n_micro, dtype):
    torch.manual_seed(0)
    built = {name: _build(kind, shape, dtype) for name, (kind, shape) in layouts.items()}

    def step_of(name):
        kind = layouts[name][0]
        grid, model, cuts = built[name]
        x, y = _batch(kind, dtype)
        if kind == "dp_tp":
            return lambda: dp_tp_step(model, grid, x, y, loss_fn, 1e-3)
        return lambda: dp_pp_step(model, cuts, grid, x, y, loss_fn, n_micro, 1e-3, gpipe)

    # round 0 warms up and is left out
    return interleaved_step_times({name: step_of(name) for name in layouts}, rounds=rounds + 1, repeats=1)


def time_layouts(layouts, dp_tp_step, dp_pp_step, rounds=5, n_micro=4, dtype=torch.float32, deadline=180):
    """{name: [seconds of each round]} of one training step per layout, interleaved (4 ranks).

    layouts: {name: ("dp_tp", (dp, tp)) or ("dp_pp", (dp, pp))}, each run with the learner's step."""
    per_rank = launch(_timing_side, 4, layouts, dp_tp_step, dp_pp_step, rounds, n_micro, dtype,
                      deadline=deadline)
    return {name: [max(ts) for ts in zip(*(r[name] for r in per_rank), strict=True)] for name in layouts}


def _calibration_side(sizes, repeats):
    a = torch.randn(ROWS, MLP_MODEL["d_model"])
    w = torch.randn(MLP_MODEL["d_hidden"], MLP_MODEL["d_model"])
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats * 4):
        a @ w.T
    matmul = (time.perf_counter() - start) / (repeats * 4)
    flops = 2 * ROWS * MLP_MODEL["d_model"] * MLP_MODEL["d_hidden"] / matmul
    seconds = {}
    for nbytes in sizes:
        t = torch.ones(nbytes // 4)
        samples = []
        for _ in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            samples.append(elapsed.item())
        seconds[nbytes] = statistics.median(samples[1:])
    return flops, seconds


def calibrate(sizes=(4096, 4 << 20), repeats=7):
    """{"flops", "alpha", "beta"} of 4 ranks on this machine (see the module docstring)."""
    results = launch(_calibration_side, 4, list(sizes), repeats)
    flops = statistics.median(r[0] for r in results)
    seconds = results[0][1]
    (s1, t1), (s2, t2) = sorted(seconds.items())
    n = 4
    # t = steps · alpha + sent(S) / beta (a ring all-reduce), at two sizes
    steps, per_byte = ring_traffic(1.0, n)
    slope = (t2 - t1) / (s2 - s1)
    beta = per_byte / slope if slope > 0 else float("inf")
    alpha = max((t1 - per_byte * s1 / beta) / steps, 0.0)
    return {"flops": flops, "alpha": alpha, "beta": beta}


def toy_models():
    """The two toy models in the cost model's terms (float32, tokens = rows, one 'layer' per block)."""
    mlp_params = sum(p.numel() for p in dp_tp_model(**MLP_MODEL).parameters())
    stack_params = sum(p.numel() for p in dp_pp_model(**STACK_MODEL).parameters())
    common = dict(heads=0, seq=1, batch=ROWS, bytes_per_value=4, recompute=False)  # 0 heads: no attention
    return {"dp_tp": dict(name="residual MLP", params=mlp_params, layers=MLP_MODEL["blocks"],
                          hidden=MLP_MODEL["d_model"], tp_all_reduces=2, **common),
            "dp_pp": dict(name="Linear stack", params=stack_params, layers=STACK_MODEL["layers"],
                          hidden=STACK_MODEL["width"], **common)}


def predictions(layouts, machine, n_micro=4):
    """{name: predict(...)} of each layout for the toy models on this machine (one node of 4 ranks)."""
    here = cluster(nodes=1, gpus_per_node=4, memory=1e12, flops=machine["flops"],
                   intra_bandwidth=machine["beta"], intra_latency=machine["alpha"])
    models = toy_models()
    out = {}
    for name, (kind, (dp, other)) in layouts.items():
        tp, pp = (other, 1) if kind == "dp_tp" else (1, other)
        out[name] = predict(models[kind], here, dp, tp, pp, n_micro if pp > 1 else 1)
    return out


def print_predicted_vs_measured(layouts, times, machine, baselines):
    """A table: predicted and measured ms per step, and each measured time against its baseline's."""
    predicted = predictions(layouts, machine)
    print(f"this machine, 4 ranks: {machine['flops'] / 1e9:.1f} GFLOP/s per rank while all compute, "
          f"all-reduce alpha {machine['alpha'] * 1e6:.0f} us, beta {machine['beta'] / 1e9:.2f} GB/s")
    print(f"{'layout':>16} {'predicted':>10} {'measured':>10} {'measured/predicted':>19} {'vs baseline':>12}")
    for name in layouts:
        measured = statistics.median(times[name])
        base = baselines[layouts[name][0]]
        ratio = statistics.median(t / b for t, b in zip(times[name], times[base], strict=True))
        print(f"{name:>16} {predicted[name]['time'] * 1e3:>7.1f} ms {measured * 1e3:>7.1f} ms "
              f"{measured / predicted[name]['time']:>18.2f}x {ratio:>11.2f}x")
