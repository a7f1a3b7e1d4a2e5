"""Hidden checks of 11_less_communication. Each raises a short AssertionError saying what is wrong.

The yardstick of each is a single-process simulation of the N workers, written here from the
notebook's definitions and never from the learner's code:

  * top-k: every worker keeps its residual, sends the k largest |gradient + residual|; the average
    is the sum of the N sparse vectors, added in rank order, divided by N. The inputs are exact
    (dpcourse.topics.compression.data), so for N = 2 and 4 the distributed result must equal it
    bit for bit; for N = 3 the division by 3 rounds, and the check allows 1e-15 relative.
  * PowerSGD: N gradients of the same replicated model, P = sum_r M_r Q, P̂ = orthonormal basis of P,
    Q = sum_r M_rᵀ P̂ / N, update P̂ Qᵀ, error = (gradient + old error) - update; first Q drawn from
    torch.Generator().manual_seed(0), later Q's reused (warm start). Float64; the orthogonalisation
    may differ (QR or Gram-Schmidt) by rounding only, so 1e-9.
  * local SGD: N replicas, each plain SGD on its shares, averaged after steps H, 2H, ...
  * asynchronous SGD: theta_{t+1} = theta_t - lr · grad_t(theta_{max(0, t - delay)}) on batch t.

Communication is judged from the records runs.launch_run returns (the grader's router's own count
when graded).
"""

import torch

from dpcourse.checks.core import TOLERANCES, ratio_hint
from dpcourse.checks.params import expect_same_state
from dpcourse.topics.compression.checks import (
    expect_error_feedback,
    expect_local_sgd_calls,
    expect_low_rank,
    expect_powersgd_bytes,
    expect_ranks_agree,
    expect_server_traffic,
    expect_tensor,
    expect_topk_bytes,
    expect_topk_pair,
    expect_topk_run,
)
from dpcourse.topics.compression.costs import compressible
from dpcourse.topics.compression.data import TASK_MODEL, dyadic_gradients, task_data
from dpcourse.topics.compression.runs import (
    LR,
    async_batches,
    async_run,
    build_model,
    launch_run,
    local_sgd_run,
    powersgd_run,
    topk_run,
)
from dpcourse.toys.data import my_share
from dpcourse.toys.models import loss_fn

# --------------------------------------------------------------------------- simulations

REFERENCES = {
    "topk_compress": "torch.topk of the magnitudes on exact (dyadic) gradients; 8 bytes per kept entry",
    "topk_all_reduce": "simulate_topk: the N workers with their residuals in one process, summed in rank "
                       "order; the all-gather's bytes",
    "powersgd_hook": "simulate_powersgd: P, orthonormal P, Q averaged, warm start, error feedback, in "
                     "float64 in one process; the all-reduce sizes of P and Q",
    "local_sgd": "simulate_local_sgd: N replicas of plain SGD on their shares, averaged after steps H, "
                 "2H, ...; one all-reduce per averaging",
    "async_sgd": "simulate_async: theta_{t+1} = theta_t - lr grad_t(theta_{max(0, t - delay)}) on batch t; "
                 "the server's p2p messages",
}


def simulate_topk(grads, k, error_feedback=True):
    """[(average, [residual of each rank]) per step]: N workers in one process (see the docstring)."""
    world_size = len(grads)
    residuals = [torch.zeros_like(grads[r][0]) for r in range(world_size)]
    out = []
    for step in range(len(grads[0])):
        sent, returned = [], []
        for rank in range(world_size):
            acc = grads[rank][step] + residuals[rank]
            top = torch.topk(acc.abs(), k).indices
            s = torch.zeros_like(acc)
            s[top] = acc[top]
            sent.append(s)
            returned.append(acc - s)
            residuals[rank] = acc - s if error_feedback else torch.zeros_like(acc)
        total = sent[0].clone()
        for s in sent[1:]:
            total = total + s
        out.append((total / world_size, returned))
    return out


def _orthonormal(P):
    return torch.linalg.qr(P).Q


def simulate_powersgd(model, seed, steps, per_rank, world_size, matrix_rank, lr=LR):
    """{"grads": [per step {name: applied gradient}], "state": final parameters}."""
    net = build_model(model, seed)
    X, Y = task_data(steps, per_rank, world_size, seed)
    names = [name for name, _ in net.named_parameters()]
    params = list(net.parameters())
    errors = [{name: torch.zeros_like(p) for name, p in zip(names, params, strict=True)}
              for _ in range(world_size)]
    qs, applied_all = {}, []
    for step in range(steps):
        wanted = []
        for rank in range(world_size):
            xb, yb = my_share(X, Y, step, per_rank, rank=rank, world_size=world_size)
            grads = torch.autograd.grad(loss_fn(net(xb), yb), params)
            wanted.append({name: g + errors[rank][name] for name, g in zip(names, grads, strict=True)})
        applied = {}
        for name, p in zip(names, params, strict=True):
            shape = tuple(p.shape)
            if compressible(shape, matrix_rank):
                ms = [w[name].reshape(shape[0], -1) for w in wanted]
                n, m = ms[0].shape
                if name not in qs:
                    g = torch.Generator().manual_seed(0)
                    qs[name] = torch.randn(m, min(matrix_rank, n, m), generator=g, dtype=p.dtype)
                P = sum(M @ qs[name] for M in ms)
                P_hat = _orthonormal(P)
                Q = sum(M.T @ P_hat for M in ms) / world_size
                qs[name] = Q
                applied[name] = (P_hat @ Q.T).reshape(shape)
            else:
                applied[name] = sum(w[name] for w in wanted) / world_size
        for rank in range(world_size):
            for name in names:
                errors[rank][name] = wanted[rank][name] - applied[name]
        with torch.no_grad():
            for name, p in zip(names, params, strict=True):
                p -= lr * applied[name]
        applied_all.append(applied)
    return {"grads": applied_all, "state": {n: p.detach().clone() for n, p in net.named_parameters()}}


def _sgd_step(net, xb, yb, lr):
    net.zero_grad(set_to_none=True)
    loss_fn(net(xb), yb).backward()
    with torch.no_grad():
        for p in net.parameters():
            p -= lr * p.grad


def simulate_local_sgd(model, seed, steps, per_rank, world_size, H, lr=LR):
    """Each replica's final parameters: plain SGD on its shares, averaged after steps H, 2H, ..."""
    replicas = [build_model(model, seed) for _ in range(world_size)]
    X, Y = task_data(steps, per_rank, world_size, seed)
    for step in range(steps):
        for rank, net in enumerate(replicas):
            _sgd_step(net, *my_share(X, Y, step, per_rank, rank=rank, world_size=world_size), lr)
        if (step + 1) % H == 0:
            with torch.no_grad():
                for ps in zip(*[net.parameters() for net in replicas], strict=True):
                    mean = sum(p.detach().clone() for p in ps) / world_size
                    for p in ps:
                        p.copy_(mean)
    return [{n: p.detach().clone() for n, p in net.named_parameters()} for net in replicas]


def simulate_async(model, seed, updates, per_update, delay, lr=LR):
    """The server's final parameters: theta_{t+1} = theta_t - lr·grad_t(theta_{max(0, t - delay)})."""
    net = build_model(model, seed)
    params = list(net.parameters())
    history = [[p.detach().clone() for p in params]]
    for t, (xb, yb) in enumerate(async_batches(updates, per_update, seed)):
        stale = build_model(model, seed)
        with torch.no_grad():
            for p, v in zip(stale.parameters(), history[max(0, t - delay)], strict=True):
                p.copy_(v)
        grads = torch.autograd.grad(loss_fn(stale(xb), yb), list(stale.parameters()))
        history.append([v - lr * g for v, g in zip(history[-1], grads, strict=True)])
    return {n: v for (n, _), v in zip(net.named_parameters(), history[-1], strict=True)}


def _shapes(model=TASK_MODEL):
    return {name: tuple(p.shape) for name, p in build_model(model, 0).named_parameters()}


def _param_bytes(model=TASK_MODEL):
    return sum(p.numel() * p.element_size() for p in build_model(model, 0).parameters())


# --------------------------------------------------------------------------- 1. topk_compress


def check_topk_compress(topk_compress, topk_decompress):
    g = torch.Generator().manual_seed(11)
    cases = [(torch.randn(7, 9, generator=g), 5), (torch.randn(40, generator=g, dtype=torch.float64), 1),
             (torch.randn(3, 4, 5, generator=g), 60), (torch.randn(1, generator=g, dtype=torch.float64), 1)]
    for x, k in cases:
        got = topk_compress(x, k)
        expect_topk_pair(got, x, k)
        flat = x.reshape(-1)
        dense = torch.zeros_like(flat)
        top = torch.topk(flat.abs(), k).indices
        dense[top] = flat[top]
        expect_tensor(topk_decompress(got[0], got[1], flat.numel()), dense,
                      f"topk_decompress of topk_compress(x of shape {tuple(x.shape)}, k={k})")
    values = torch.tensor([2.5, -1.0], dtype=torch.float32)
    indices = torch.tensor([7, 0], dtype=torch.int32)
    expected = torch.zeros(9, dtype=torch.float32)
    expected[7], expected[0] = 2.5, -1.0
    expect_tensor(topk_decompress(values, indices, 9), expected,
                  "topk_decompress(tensor([2.5, -1.]), tensor([7, 0], dtype=int32), 9)")
    for k in (0, 13):
        try:
            topk_compress(torch.ones(12), k)
        except ValueError:
            continue
        except Exception as exc:  # noqa: BLE001 - the learner's error, named in the message
            raise AssertionError(f"topk_compress(a tensor of 12 elements, k={k}) raised "
                                 f"{type(exc).__name__}: {exc}; expected a ValueError that says k must be "
                                 f"between 1 and 12") from None
        raise AssertionError(f"topk_compress(a tensor of 12 elements, k={k}) returned without complaint: "
                             f"raise a ValueError (k must be between 1 and 12)")


# --------------------------------------------------------------------------- 2. topk_all_reduce


def _expect_simulated_topk(results, grads, k, exact, error_feedback=True):
    for step, (average, residuals) in enumerate(simulate_topk(grads, k, error_feedback)):
        for rank, result in enumerate(results):
            what = f"{len(grads)} ranks, k={k}, rank {rank}, step {step}"
            atol = TOLERANCES["float64 one rounding"][0] * max(1.0, average.abs().max().item())
            expect_tensor(result["averages"][step], average, f"{what}: the average", exact=exact, atol=atol)
            expect_tensor(result["residuals"][step], residuals[rank], f"{what}: the new residual")


def check_topk_all_reduce(topk_all_reduce):
    cases = [  # (ranks, steps, numel, k, dtype, exact)
        (2, 4, 50, 4, torch.float32, True),
        (4, 3, 33, 1, torch.float64, True),
        (3, 3, 20, 5, torch.float64, False),
        (2, 2, 6, 6, torch.float64, True),  # k = numel: everything is sent, residuals stay zero
    ]
    for seed, (world_size, steps, numel, k, dtype, exact) in enumerate(cases, start=30):
        grads = dyadic_gradients(world_size, steps, numel, seed=seed, dtype=dtype)
        results = launch_run(topk_run, world_size, topk_all_reduce, grads, k)
        expect_topk_run(results, grads, k, exact=exact)
        _expect_simulated_topk(results, grads, k, exact)
        expect_topk_bytes(results, k, torch.empty(0, dtype=dtype).element_size(), steps, numel)


# --------------------------------------------------------------------------- 3. powersgd_hook


def check_powersgd_hook(powersgd_hook, PowerSGDState):
    shapes = _shapes()
    for world_size, matrix_rank, steps in [(3, 2, 3), (2, 1, 4), (1, 1, 2)]:
        results = launch_run(powersgd_run, world_size, powersgd_hook, PowerSGDState, matrix_rank, TASK_MODEL,
                             5, steps, 2)
        what = f"powersgd_hook at rank {matrix_rank} on {world_size} rank(s)"
        expect_powersgd_bytes(results, shapes, matrix_rank, 8, steps)
        expect_low_rank(results, shapes, matrix_rank)
        expect_error_feedback(results, shapes, matrix_rank)
        expected = simulate_powersgd(TASK_MODEL, 5, steps, 2, world_size, matrix_rank)
        for step, grads in enumerate(expected["grads"]):
            for name, grad in grads.items():
                got = results[0]["grads"][step][name]
                if not torch.allclose(got, grad, rtol=0, atol=TOLERANCES["float64 absolute"][0]):
                    raise AssertionError(
                        f"{what}, step {step}: the gradient applied to {name} is {_short(got)}, the "
                        f"simulation of {world_size} workers gives {_short(grad)} (largest difference "
                        f"{(got - grad).abs().max().item():.3g}){ratio_hint(got, grad)}")
        for rank, result in enumerate(results):
            expect_same_state(result["state"], expected["state"], f"{what}: the parameters after {steps} "
                              f"steps should match the simulation", rank=rank,
                              atol=TOLERANCES["float64 absolute"][0])


def _short(t, limit=4):
    flat = t.reshape(-1)
    shown = ", ".join(f"{v:.4g}" for v in flat[:limit].tolist())
    return f"[{shown}{', …' if flat.numel() > limit else ''}]"


# --------------------------------------------------------------------------- 4. local_sgd


def check_local_sgd(local_sgd):
    tensors = len(_shapes())
    for world_size, H, steps in [(3, 2, 5), (2, 4, 8), (1, 3, 3)]:
        results = launch_run(local_sgd_run, world_size, local_sgd, TASK_MODEL, 7, steps, 2, H)
        expect_local_sgd_calls(results, steps, H, _param_bytes(), tensors)
        expected = simulate_local_sgd(TASK_MODEL, 7, steps, 2, world_size, H)
        for rank, result in enumerate(results):
            expect_same_state(result["state"], expected[rank], f"local_sgd with H = {H} on {world_size} "
                              f"ranks, {steps} steps (averaged after steps "
                              f"{', '.join(str(s) for s in range(H, steps + 1, H)) or 'none'}), should match "
                              f"the simulation", rank=rank, atol=TOLERANCES["float64 steps absolute"][0])
        if steps % H == 0:
            expect_ranks_agree(results, f"local_sgd, H = {H}, {steps} steps")


# --------------------------------------------------------------------------- 5. async_sgd


def check_async_sgd(async_sgd):
    for workers, delay, updates in [(2, 1, 6), (3, 2, 8), (1, 3, 5), (3, 0, 4)]:
        results = launch_run(async_run, workers + 1, async_sgd, TASK_MODEL, 9, updates, 4, delay)
        expect_server_traffic(results, updates, workers, _param_bytes())
        expected = simulate_async(TASK_MODEL, 9, updates, 4, delay)
        what = (f"async_sgd with {workers} worker(s), delay {delay}, {updates} updates: the server's "
                f"parameters should match the simulation (update t applies the gradient computed at version "
                f"max(0, t - {delay}) to the latest version)")
        expect_same_state(results[0]["state"], expected, what, rank=0,
                          atol=TOLERANCES["float64 steps absolute"][0])


__all__ = ["check_topk_compress", "check_topk_all_reduce", "check_powersgd_hook", "check_local_sgd",
           "check_async_sgd", "simulate_topk", "simulate_powersgd", "simulate_local_sgd", "simulate_async"]
