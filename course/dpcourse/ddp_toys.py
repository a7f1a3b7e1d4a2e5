"""Small models, generated data and the single-process reference that DDP exercises are checked against.

The one fact behind every DDP check: N ranks that start from the same model, each
run backward on its own shard of a global batch and average their gradients,
take exactly the step one process takes on the whole global batch. So a DDP
implementation is correct when, after several steps, its parameters equal those
of `train_single_process` on the same global batches -- parameter by parameter.

Why float64 by default: averaging N shard means and taking one mean over the
global batch add numbers in different orders. In float32 the two differ by
~1e-7 and the difference grows with steps; in float64 it stays near 1e-15, so a
tolerance of 1e-9 separates "right" from "wrong by a factor of N" with no doubt.

Why generated data: no downloads, and every rank (and the reference) can rebuild
exactly the same tensors from a seed.
"""

from collections import OrderedDict

import torch
import torch.distributed as dist
from torch import nn

from .checks import describe
from .env import rank_device


def _seeded(build, seed, dtype, device):
    """Build a module with torch's default init drawn from `seed`, without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = build()
    return module.to(dtype=dtype, device=device if device is not None else "cpu")


def deep_mlp(depth=4, width=16, d_in=8, d_out=2, seed=0, dtype=torch.float64, device=None):
    """An MLP of `depth` hidden Linear+Tanh layers, named fc0, fc1, ..., head (deep = many buckets).

    The same seed gives the same initial parameters in every process, on every device.
    """
    def build():
        layers, width_in = OrderedDict(), d_in
        for i in range(depth):
            layers[f"fc{i}"] = nn.Linear(width_in, width)
            layers[f"act{i}"] = nn.Tanh()
            width_in = width
        layers["head"] = nn.Linear(width_in, d_out)
        return nn.Sequential(layers)
    return _seeded(build, seed, dtype, device)


def mlp_with_batchnorm(width=16, d_in=8, d_out=2, seed=0, dtype=torch.float64, device=None):
    """An MLP with a BatchNorm1d: it has buffers (running_mean, running_var, num_batches_tracked)."""
    def build():
        return nn.Sequential(OrderedDict(fc0=nn.Linear(d_in, width), bn=nn.BatchNorm1d(width),
                                         act=nn.Tanh(), head=nn.Linear(width, d_out)))
    return _seeded(build, seed, dtype, device)


class FrozenFirstLayer(nn.Module):
    """An MLP whose first layer is frozen (requires_grad=False): its parameters never get a gradient."""

    def __init__(self, width=16, d_in=8, d_out=2):
        super().__init__()
        self.frozen = nn.Linear(d_in, width).requires_grad_(False)
        self.fc = nn.Linear(width, width)
        self.head = nn.Linear(width, d_out)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(torch.tanh(self.frozen(x)))))


class TiedLayers(nn.Module):
    """An MLP that applies the same hidden layer twice: one parameter, two contributions to its gradient."""

    def __init__(self, width=16, d_in=8, d_out=2):
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.shared = nn.Linear(width, width)
        self.head = nn.Linear(width, d_out)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h))
        return self.head(h)


class UnusedHead(nn.Module):
    """An MLP with a second head that forward never calls: its parameters get no gradient."""

    def __init__(self, width=16, d_in=8, d_out=2):
        super().__init__()
        self.fc = nn.Linear(d_in, width)
        self.head = nn.Linear(width, d_out)
        self.unused_head = nn.Linear(width, d_out)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(x)))


def frozen_first_layer(seed=0, dtype=torch.float64, device=None):
    return _seeded(FrozenFirstLayer, seed, dtype, device)


def tied_layers(seed=0, dtype=torch.float64, device=None):
    return _seeded(TiedLayers, seed, dtype, device)


def unused_head(seed=0, dtype=torch.float64, device=None):
    return _seeded(UnusedHead, seed, dtype, device)


MODELS = {"deep_mlp": deep_mlp, "mlp_with_batchnorm": mlp_with_batchnorm,
          "frozen_first_layer": frozen_first_layer, "tied_layers": tied_layers,
          "unused_head": unused_head}


def loss_fn(output, target):
    """Mean squared error, averaged over the batch: the mean that DDP's gradient averaging reproduces."""
    return ((output - target) ** 2).mean()


def global_batch(X, Y, step, global_size):
    """The rows of global batch number `step`: rows step*global_size ... (step+1)*global_size - 1."""
    rows = slice(step * global_size, (step + 1) * global_size)
    return X[rows], Y[rows]


def my_share(X, Y, step, per_rank, rank=None, world_size=None, device=None):
    """This rank's share of global batch `step`: its `per_rank` consecutive rows, on rank_device().

    With 4 ranks and per_rank=32 (a global batch of 128), rank 2 takes rows 64..95 of the batch.
    """
    rank = dist.get_rank() if rank is None else rank
    world_size = dist.get_world_size() if world_size is None else world_size
    xb, yb = global_batch(X, Y, step, per_rank * world_size)
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    device = rank_device() if device is None else device
    return xb[rows].to(device), yb[rows].to(device)


def sgd(model, lr=0.1):
    """The optimizer of the checks: plain SGD (momentum would hide nothing, and adds nothing)."""
    return torch.optim.SGD(model.parameters(), lr=lr)


def train_single_process(model, X, Y, steps, global_size, make_optimizer=sgd):
    """The reference: one process, `steps` optimizer steps on whole global batches. Returns the model."""
    opt = make_optimizer(model)
    device = next(model.parameters()).device
    for step in range(steps):
        xb, yb = global_batch(X, Y, step, global_size)
        opt.zero_grad()
        loss_fn(model(xb.to(device)), yb.to(device)).backward()
        opt.step()
    return model


def gradients_of(model):
    """{name: gradient on the CPU, or None} for every parameter."""
    return {name: None if p.grad is None else p.grad.detach().cpu().clone()
            for name, p in model.named_parameters()}


def single_process_gradients(model, x, y):
    """The gradients of loss_fn(model(x), y) in one process (the model is left unchanged)."""
    model.zero_grad(set_to_none=True)
    loss_fn(model(x), y).backward()
    grads = gradients_of(model)
    model.zero_grad(set_to_none=True)
    return grads


def state_of(model):
    """{name: tensor} of every parameter and buffer, detached, on the CPU: what checks compare."""
    state = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
    state.update({name: b.detach().cpu().clone() for name, b in model.named_buffers()})
    return state


def expect_same_state(got, expected, what, rank=None, atol=1e-9):
    """Assert two states hold the same tensors (within atol); name the first tensor that differs."""
    where = f"rank {rank}: " if rank is not None else ""
    missing = [name for name in expected if name not in got]
    if missing:
        raise AssertionError(f"{where}{what}: no tensor named {missing[0]!r}")
    for name, want in expected.items():
        have = got[name]
        if have.shape != want.shape:
            raise AssertionError(f"{where}{what}: {name} has shape {tuple(have.shape)}, expected "
                                 f"{tuple(want.shape)}")
        if want.is_floating_point():
            diff = (have.double() - want.double()).abs().max().item() if want.numel() else 0.0
            ok = diff <= atol
        else:
            diff, ok = None, torch.equal(have, want)
        if not ok:
            how_far = f" (largest difference {diff:.3g})" if diff is not None else ""
            raise AssertionError(f"{where}{what}: {name} is {describe(have)}, expected "
                                 f"{describe(want)}{how_far}")


def expect_identical_across_ranks(states, what="parameters"):
    """Assert every rank's state equals rank 0's exactly (bit for bit)."""
    for rank, state in enumerate(states[1:], start=1):
        for name, tensor in states[0].items():
            if not torch.equal(state[name], tensor):
                diff = (state[name].double() - tensor.double()).abs().max().item()
                raise AssertionError(f"rank {rank}'s {what} differ from rank 0's: {name} differs by "
                                     f"up to {diff:.3g} (ranks must stay identical)")


def _is_zero_or_none(tensor):
    return tensor is None or not tensor.any()


def expect_averaged_gradients(got, average, local, world_size, what, rank=None, atol=1e-9):
    """Assert each gradient `got` equals the global `average`; if not, say what it looks like instead.

    `local` holds this rank's own gradients (its shard only): a gradient that equals
    them was never all-reduced, one that is N times the average was summed and not
    divided, one that is local/N was divided but the all-reduce had not finished.
    """
    where = f"rank {rank}: " if rank is not None else ""
    close = lambda a, b: a.shape == b.shape and (a.double() - b.double()).abs().max().item() <= atol
    for name, want in average.items():
        have = got.get(name)
        if want is None:
            if not _is_zero_or_none(have):
                raise AssertionError(f"{where}{what}: {name} gets no gradient in one process, but has "
                                     f"{describe(have)}")
            continue
        if have is None:
            raise AssertionError(f"{where}{what}: {name} has no gradient (expected {describe(want)})")
        if close(have, want):
            continue
        hint = "is not the average over ranks"
        if close(have, want * world_size):
            hint = (f"is {world_size} times the average over ranks: all_reduce sums, so divide by the "
                    f"world size")
        elif local.get(name) is not None and close(have, local[name]):
            hint = "is still this rank's local gradient: it was not all-reduced (a parameter skipped?)"
        elif local.get(name) is not None and close(have, local[name] / world_size):
            hint = (f"is this rank's local gradient divided by {world_size}: the all-reduce had not "
                    f"finished (or was not waited for) when the gradient was read")
        raise AssertionError(f"{where}{what}: the gradient of {name} {hint}. Got {describe(have, 4)}, "
                             f"expected {describe(want, 4)}")


def expect_single_process_equivalence(results, make_model, X, Y, steps, per_rank, what,
                                      make_optimizer=sgd, atol=1e-9):
    """The check of every DDP exercise, on the results of a launch.

    results[r] = (rank r's gradients right after the first step's synchronisation,
    rank r's state after `steps` steps), each rank having trained on `my_share` of
    global batches of per_rank * N rows. Checks, in order: first-step gradients are
    the global average; ranks are identical; parameters equal one process trained
    with the same optimizer on the same global batches.
    """
    world_size = len(results)
    global_size = per_rank * world_size
    model = make_model()
    average = single_process_gradients(model, *global_batch(X, Y, 0, global_size))
    for rank, (grads, _) in enumerate(results):
        local = single_process_gradients(model, *my_share(X, Y, 0, per_rank, rank, world_size, "cpu"))
        expect_averaged_gradients(grads, average, local, world_size,
                                  f"{what}, gradients after the first step", rank=rank, atol=atol)
    expect_identical_across_ranks([state for _, state in results])
    reference = state_of(train_single_process(make_model(), X, Y, steps, global_size, make_optimizer))
    for rank, (_, state) in enumerate(results):
        expect_same_state(state, reference, f"{what}, after {steps} steps compared with one process "
                          f"on the same global batches", rank=rank, atol=atol)
