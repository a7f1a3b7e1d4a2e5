"""Every method of notebook 11 trained on the same task with the learner's code: loss against bytes.

    curves = launch(method_runs, 4, methods, 48, 8)[0] ... see `compare_methods`, which does it all

Why a module: the notebook's closing picture puts full all-reduce, top-k with and without error
feedback, PowerSGD at several ranks, local SGD at several H and asynchronous SGD at several delays on
the same axes -- the loss of the same model (`DEMO_MODEL`, float64) on held-out rows, against the
bytes all ranks together put on the network (comm.volume.bytes_sent of the recorded calls). Every run
sees the same global batches in the same order (the asynchronous runs take one global batch per
update, so with no delay they are exactly synchronous SGD), and each takes a second or two.

A method is (kind, your function(s), options):
    ("all_reduce", None, {})                              the baseline: average the gradients
    ("topk", topk_all_reduce, {"k": 90, "error_feedback": True})
    ("powersgd", (powersgd_hook, PowerSGDState), {"matrix_rank": 2})
    ("local_sgd", local_sgd, {"H": 4})                    evaluated after every block of H steps
    ("async", async_sgd, {"delay": 3})                    rank 0 serves, the others work; one point
"""

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

from dpcourse.backend import rank_device
from dpcourse.comm.recorder import CommRecorder
from dpcourse.comm.volume import bytes_sent
from dpcourse.runtime.launcher import launch
from dpcourse.topics.compression.data import task_with_held_out
from dpcourse.topics.compression.runs import LR, build_model
from dpcourse.toys.data import global_batch, my_share
from dpcourse.toys.models import loss_fn

DEMO_MODEL = ("deep_mlp", {"depth": 3, "width": 64})  # 9,026 parameters: 8 -> 64 -> 64 -> 64 -> 2


def _flat_grad(net):
    return torch.cat([p.grad.reshape(-1) for p in net.parameters()])


def _apply(net, flat, lr):
    with torch.no_grad():
        offset = 0
        for p in net.parameters():
            p -= lr * flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()


def _loss(net, x, y):
    with torch.no_grad():
        return loss_fn(net(x), y).item()


def _sent(ops):
    return bytes_sent(ops, dist.get_world_size())


def _synchronous(kind, learner, options, net, batches, lr, evaluate):
    """all_reduce / topk / powersgd: one point (bytes this rank sent so far, loss) per step."""
    world_size = dist.get_world_size()
    model = net
    if kind == "powersgd":
        from torch.nn.parallel import DistributedDataParallel

        hook, State = learner
        device = rank_device()
        model = DistributedDataParallel(net, device_ids=[device] if device.type == "cuda" else None)
        model.register_comm_hook(State(options["matrix_rank"]), hook)
        opt = torch.optim.SGD(net.parameters(), lr=lr)
    residual = None
    points, sent = [(0.0, evaluate())], 0.0
    for xb, yb in batches:
        with CommRecorder() as rec:
            if kind == "powersgd":
                opt.zero_grad()
                loss_fn(model(xb), yb).backward()
                opt.step()
            else:
                net.zero_grad(set_to_none=True)
                loss_fn(net(xb), yb).backward()
                grad = _flat_grad(net)
                if kind == "all_reduce":
                    dist.all_reduce(grad)
                    average = grad / world_size
                else:
                    if residual is None or not options.get("error_feedback", True):
                        residual = torch.zeros_like(grad)
                    average, residual = learner(grad, residual, options["k"])
                _apply(net, average, lr)
        sent += _sent(rec.ops)
        points.append((sent, evaluate()))
    return points


def method_runs(methods, steps, per_rank, seed=1, lr=LR, model=DEMO_MODEL):
    """Inside a rank: every method in turn, from the same start. Returns {label: [(bytes this rank
    sent so far, held-out loss), ...]}: one point per step (per block of H steps for local SGD,
    start and end for asynchronous SGD)."""
    device = rank_device()
    world_size = dist.get_world_size()
    X, Y, xh, yh = task_with_held_out(steps, per_rank, world_size, seed)
    xh, yh = xh.to(device), yh.to(device)
    out = {}
    for label, (kind, learner, options) in methods.items():
        net = build_model(model, seed, device)
        evaluate = lambda net=net: _loss(net, xh, yh)  # noqa: E731 - bound to this run's model
        if kind in ("all_reduce", "topk", "powersgd"):
            batches = [my_share(X, Y, step, per_rank, device=device) for step in range(steps)]
            out[label] = _synchronous(kind, learner, options, net, batches, lr, evaluate)
        elif kind == "local_sgd":
            batches = [my_share(X, Y, step, per_rank, device=device) for step in range(steps)]
            H, points, sent = options["H"], [(0.0, evaluate())], 0.0
            for start in range(0, steps - steps % H, H):
                with CommRecorder() as rec:
                    learner(net, batches[start:start + H], lr, H)
                sent += _sent(rec.ops)
                points.append((sent, evaluate()))
            out[label] = points
        elif kind == "async":
            batches = [tuple(t.to(device) for t in global_batch(X, Y, step, per_rank * world_size))
                       for step in range(steps)]
            start_loss = evaluate()
            with CommRecorder() as rec:
                learner(net, batches, lr, options["delay"])
            out[label] = [(0.0, start_loss), (_sent(rec.ops), evaluate())]
        else:
            raise ValueError(f"unknown method kind {kind!r}")
        dist.barrier()
    return out


def compare_methods(methods, world_size=4, steps=48, per_rank=8, **options):
    """Launch `method_runs` and combine the ranks: {label: [(bytes all ranks sent so far, loss on
    rank 0's model -- the server's for asynchronous SGD), ...]}."""
    per_rank_results = launch(method_runs, world_size, methods, steps, per_rank, deadline=300, **options)
    curves = {}
    for label, first in per_rank_results[0].items():
        totals = [sum(r[label][i][0] for r in per_rank_results) for i in range(len(first))]
        curves[label] = [(total, loss) for total, (_, loss) in zip(totals, first, strict=True)]
    return curves


STYLE = {"all_reduce": ("black", "-"), "topk": ("tab:blue", "-"), "powersgd": ("tab:orange", "-"),
         "local_sgd": ("tab:green", "-"), "async": ("tab:red", "none")}


def plot_loss_vs_bytes(curves, methods, steps, title=""):
    """Two panels: held-out loss against steps, and against bytes on the network (log scale)."""
    fig, (by_step, by_bytes) = plt.subplots(1, 2, figsize=(12, 5.2))
    shades = {}
    for label, points in curves.items():
        kind = methods[label][0]
        colour, line = STYLE[kind]
        shade = shades.setdefault(kind, 0)
        shades[kind] += 1
        alpha = max(0.35, 1.0 - 0.25 * shade)
        losses = [loss for _, loss in points]
        if kind == "local_sgd":
            xs = [i * methods[label][2]["H"] for i in range(len(points))]
        elif kind == "async":
            xs = [0, steps]
        else:
            xs = list(range(len(points)))
        marker = "x" if kind == "async" else None
        dashes = (0, (4, 2)) if methods[label][2].get("error_feedback", True) is False else line
        if kind == "async":  # only the end is measured: no line from the start
            xs, losses, dashes = xs[1:], losses[1:], "none"
        by_step.plot(xs, losses, color=colour, alpha=alpha, marker=marker, linestyle=dashes, label=label)
        after_start = points[1:]  # the start has sent nothing: no place on a log scale
        by_bytes.plot([b for b, _ in after_start], [loss for _, loss in after_start], color=colour,
                      alpha=alpha, marker=marker or ".", markersize=4, linestyle=dashes, label=label)
    start = next(iter(curves.values()))[0][1]
    for ax in (by_step, by_bytes):
        ax.axhline(start, color="#999999", linestyle=":", linewidth=1)
        ax.set_ylabel("loss on held-out rows")
        ax.set_yscale("log")
    by_step.set_xlabel("optimizer steps (same samples for every method)")
    by_bytes.set_xlabel("bytes on the network, all ranks together (log scale)")
    by_bytes.set_xscale("log")
    # one legend for both panels, under them: inside a panel it covers the curves' starts
    handles, labels = by_bytes.get_legend_handles_labels()
    rows = -(-len(labels) // 4)
    fig.legend(handles, labels, fontsize=8, ncol=4, loc="lower center", frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.045 * rows + 0.02, 1, 1))
    plt.show()


def summary_rows(curves):
    """(label, total bytes, final loss) per run, for a table under the picture."""
    return [(label, points[-1][0], points[-1][1]) for label, points in curves.items()]
