"""Memory per GPU of model states under DDP and the ZeRO stages: the ZeRO paper's formulas.

    model_state_bytes(7.5e9, 64, "ZeRO-1")   # {"weights": 15e9, "gradients": 15e9, "optimizer": 1.4e9}

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC 2020,
sections 3.1 and 5: mixed-precision Adam on Ψ parameters keeps fp16 weights (2Ψ bytes), fp16
gradients (2Ψ) and an optimizer state of KΨ with K = 12; partitioning the optimizer state, the
gradients, then the weights over N_d GPUs (topics.zero.memory says more). Here, below the topics,
because notebook 01 (memory per GPU), 09 (the planner) and 10 (ZeRO) use the same formula.
"""

STAGES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
KINDS = ("weights", "gradients", "optimizer")


def model_state_bytes(psi, n, stage, weight_bytes=2, grad_bytes=2, K=12):
    """Bytes of weights, gradients and optimizer state per GPU, by the ZeRO paper's formulas.

    psi parameters, n data-parallel GPUs; defaults are mixed-precision Adam (fp16 weights and
    gradients, K = 12). Returns {"weights", "gradients", "optimizer"} in bytes.
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    shards = {"DDP": (1, 1, 1), "ZeRO-1": (1, 1, n), "ZeRO-2": (1, n, n), "ZeRO-3": (n, n, n)}[stage]
    per_kind = (weight_bytes * psi, grad_bytes * psi, K * psi)
    return dict(zip(KINDS, (b / s for b, s in zip(per_kind, shards, strict=True)), strict=True))
