"""Memory per rank for DDP and the ZeRO stages: the paper's formulas, and what a rank really holds.

    model_state_bytes(7.5e9, 64, "ZeRO-1")   # {"weights": 15e9, "gradients": 15e9, "optimizer": 1.4e9}
    held_bytes(model, optimizer)              # inside a rank: the same three numbers, measured

Why a module: notebook 10 puts the formula of each ZeRO stage next to a measurement of
the learner's own run, and grades "each rank keeps 1/N" from measurements. The formula is
the ZeRO paper's (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", SC 2020, sections 3.1 and 5): mixed-precision Adam on Ψ parameters
keeps fp16 weights (2Ψ bytes), fp16 gradients (2Ψ) and an optimizer state of KΨ with
K = 12 (fp32 master weights, momentum and variance, 4Ψ each): 16Ψ per GPU under DDP.
Partitioning the optimizer state (ZeRO-1, P_os), then the gradients (ZeRO-2, P_os+g), then
the weights (ZeRO-3, P_os+g+p) over N_d GPUs gives 4Ψ + KΨ/N_d, 2Ψ + (2+K)Ψ/N_d and
(4+K)Ψ/N_d (the paper's Figure 1: 7.5B parameters on 64 GPUs need 120, 31.4, 16.6 and
1.9 GB). Activations, temporary buffers and fragmentation come on top.

The measurement counts every tensor a rank holds through the model and the optimizer,
each storage once: the model's parameters (and buffers) and any tensor attributes of its modules
(FlatUnit's views, 0 bytes while freed), their gradients, and the optimizer's state plus
the tensors it steps that are not the model's (a master copy of a shard).
"""

import torch

from dpcourse.reference.memory import KINDS, STAGES, model_state_bytes  # noqa: F401 - 10's names


def implementation_bytes(psi, n, stage, element_size=8, state_per_element=2):
    """What the implementations of notebook 10 hold per rank right after an optimizer step, in bytes,
    for psi trainable elements of `element_size` bytes and Adam (exp_avg, exp_avg_sq: 2 per element).

      DDP     weights psi, gradients psi, Adam's state 2 psi (no master copy: float64 throughout)
      ZeRO-1  ShardedOptimizer after DDP's averaging: the full gradients, plus the shard's own
              gradient (psi/N); optimizer: the shard (a master copy, as ZeRO's fp32 partition) + state
      ZeRO-2  the same with reduce_scatter_gradients: only the shard's gradient is left
      ZeRO-3  MiniFSDP between steps: the shards are the weights (no master copy), units freed
    Shards are psi/N here; rank 0 holds up to one element more per sharded vector (tensor_split),
    and Adam keeps a 4-byte step counter per tensor it steps.
    """
    e, k = element_size, state_per_element
    table = {"DDP": (psi, psi, k * psi),
             "ZeRO-1": (psi, psi + psi / n, (1 + k) * psi / n),
             "ZeRO-2": (psi, psi / n, (1 + k) * psi / n),
             "ZeRO-3": (psi / n, psi / n, k * psi / n)}
    if stage not in table:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    return dict(zip(KINDS, (e * v for v in table[stage]), strict=True))


def _storage_key(t):
    storage = t.untyped_storage()
    return (storage.data_ptr(), t.device), storage.nbytes()


def _module_tensors(module):
    """Parameters and buffers of every submodule and plain tensor attributes (FlatUnit's views),
    with the leaf a view was taken from (whose .grad is the view's gradient)."""
    found = list(module.parameters()) + list(module.buffers())
    for sub in module.modules():
        for value in vars(sub).values():
            if isinstance(value, torch.Tensor):
                found.append(value)
                if value._base is not None:
                    found.append(value._base)
    return found


def _unique_bytes(tensors, seen):
    total = 0
    for t in tensors:
        if t is None:
            continue
        key, nbytes = _storage_key(t)
        if nbytes and key not in seen:
            seen.add(key)
            total += nbytes
    return total


def held_bytes(module, optimizer=None):
    """Inside a rank: {"weights", "gradients", "optimizer"} bytes held through `module` and
    `optimizer` (a torch optimizer), each storage counted once, in the first kind it appears in."""
    seen = set()
    tensors = _module_tensors(module)
    stepped = [p for g in optimizer.param_groups for p in g["params"]] if optimizer is not None else []
    weights = _unique_bytes(tensors, seen)
    gradients = _unique_bytes([t.grad for t in tensors + stepped if t.is_leaf], seen)  # views have none
    state = []
    if optimizer is not None:
        for per_param in optimizer.state.values():
            state += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
    optimizer_bytes = _unique_bytes(stepped + state, seen)
    return {"weights": weights, "gradients": gradients, "optimizer": optimizer_bytes}


def optimizer_summary(optimizer, model_tensors=()):
    """Inside a rank: what a torch optimizer holds, as plain values a test can judge.

    {"numel": elements it steps, "storage_bytes": bytes of the storages those tensors live in,
    except storages of `model_tensors` (a slice of a bigger tensor keeps all of it alive; a view
    of the model's own weights costs nothing more), "state_bytes": bytes of its state tensors,
    "state": {key: that state as one flat CPU vector, in parameter order}, "values": the tensors it
    steps, as one flat CPU vector}.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    seen = {_storage_key(t)[0] for t in model_tensors}
    state_tensors, flat_state = [], {}
    for p in params:
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                state_tensors.append(value)
                if value.shape == p.shape:
                    flat_state.setdefault(key, []).append(value.detach().reshape(-1).cpu())
    return {"numel": sum(p.numel() for p in params),
            "storage_bytes": _unique_bytes(params, seen),
            "state_bytes": sum(t.numel() * t.element_size() for t in state_tensors),
            "state": {k: torch.cat(v) for k, v in flat_state.items()},
            "values": torch.cat([p.detach().reshape(-1).cpu() for p in params]) if params else torch.zeros(0)}


def format_decimal_bytes(n):
    """'1.9 GB', '7.95 kB': decimal units, as the ZeRO paper quotes them."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"
