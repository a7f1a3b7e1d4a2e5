"""What a (dp, pp, tp) layout of a GPT should cost: memory per rank and time per step, with the alpha-beta
model of notebooks 04 and 09, calibrated on this machine or given for a real cluster.

    machine = calibrate(8)                              # measured here: FLOP/s per rank, alpha, beta
    predict(GPTConfig().as_dict(), (2, 2, 2), batch=16, n_micro=2, machine=machine)
    # {"memory": bytes on the fullest rank, "time": seconds, "parts": {"compute": ..., "bubble": ..., ...}}

Used by notebook 13 (the planner against the measurement, and the written answer's cluster) and its
benchmark. The model, per step, every term on the critical path (nothing overlapped):
  compute  6 P T + 6 L s^2 d B FLOPs (forward and backward of the weights, causal attention) over the ranks;
  bubble   1F1B's idle share: compute x (p - 1) / m (Narayanan et al. 2021, section 2.2);
  tp       per layer and micro-batch, 2 all-gathers and 2 reduce-scatters of the micro-batch's activations in
           each direction (Megatron's sequence parallelism), on the tp group's link;
  pp       per micro-batch, its activation forward and its gradient back, across each stage boundary;
  dp       fully_shard: the stage's parameters all-gathered in forward and again in backward, the gradients
           reduce-scattered (3 ring passes of the stage's parameters over dp);
each collective priced as a ring (comm.volume.ring_traffic): alpha per step plus the bytes at the link's
bandwidth. Memory: parameters, gradients and SGD's momentum (3 values per parameter) split by tp, pp and
dp, two blocks gathered at a time by FSDP, and the activations of the micro-batches 1F1B keeps in flight
on the first stage (p of them), 34 s b h bytes of 16-bit values per layer and micro-batch over tp (Korthikanti
et al. 2022, section 4.1), plus 5 a s^2 b / t for the attention scores unless a fused kernel never keeps them.
"""

import time

import torch
import torch.distributed as dist

from dpcourse.comm.volume import ring_traffic
from dpcourse.runtime.launcher import launch
from dpcourse.toys.gpt import GPTConfig, parameter_count


def cluster(nodes=8, gpus_per_node=8, flops=140e12, memory=80e9, nvlink=300e9, network=25e9, alpha=5e-6,
            bytes_per_value=2):
    """A GPU cluster: nodes of `gpus_per_node` GPUs (A100 80 GB by default: ~140 TFLOP/s sustained in bf16,
    300 GB/s NVLink inside a node, 25 GB/s of InfiniBand per GPU between nodes), 16-bit activations,
    mixed-precision Adam's 16 bytes of model state per parameter, a fused attention kernel (no s x s scores
    kept for backward)."""
    return dict(nodes=nodes, per_node=gpus_per_node, flops=flops, memory=memory, beta_intra=nvlink,
                beta_inter=network, alpha=alpha, bytes_per_value=bytes_per_value, state_bytes=16,
                fused_attention=True)


def _spans_nodes(group, per_node):
    return len({r // per_node for r in group}) > 1


def _collective(nbytes, group_size, machine, inter, phases=1):
    """Seconds of one ring collective of `nbytes` over a group (alpha per step, bytes at the link's rate)."""
    steps, sent = ring_traffic(nbytes, group_size, phases=phases)
    beta = machine["beta_inter"] if inter else machine["beta_intra"]
    return steps * machine["alpha"] + sent / beta


def predict(model, layout, batch, n_micro, machine):
    """Memory on the fullest rank (bytes) and time per step (seconds) of `model` (GPTConfig's fields) trained
    in `layout` = (dp, pp, tp) with a global batch of `batch` sequences in `n_micro` micro-batches."""
    config = GPTConfig(**model) if isinstance(model, dict) else model
    dp, pp, tp = layout
    world = dp * pp * tp
    L, d, s, h = config.n_layers, config.d_model, config.seq, config.n_heads
    v = machine["bytes_per_value"]
    params = parameter_count(config)
    per_block = (params - (config.vocab + config.seq) * d - (d * config.vocab + config.vocab) - 2 * d) / L
    layers = -(-L // pp)
    stage_params = layers * per_block + (config.vocab + config.seq) * d + d * config.vocab
    micro = batch / (dp * n_micro)  # sequences per micro-batch on one rank
    tokens = batch * s
    flops = 6 * params * tokens + 6 * L * s * s * d * batch
    compute = flops / world / machine["flops"]
    bubble = compute * (pp - 1) / n_micro
    per_node = machine["per_node"]
    grid = torch.arange(world).view(dp, pp, tp)
    act = micro * s * d * v  # one micro-batch's activations between layers, whole sequence
    tp_inter = _spans_nodes(grid[0, 0].tolist(), per_node)
    pp_inter = _spans_nodes(grid[0, :, 0].tolist(), per_node)
    dp_inter = _spans_nodes(grid[:, 0, 0].tolist(), per_node)
    tp_time = layers * n_micro * 8 * _collective(act, tp, machine, tp_inter) if tp > 1 else 0.0
    pp_beta = machine["beta_inter"] if pp_inter else machine["beta_intra"]
    pp_time = 2 * n_micro * (machine["alpha"] + act / tp / pp_beta) if pp > 1 else 0.0
    dp_time = 3 * _collective(stage_params / tp * v, dp, machine, dp_inter) if dp > 1 else 0.0
    state = machine.get("state_bytes", 3 * v) * stage_params / (tp * dp)
    gathered = 2 * per_block / tp * v if dp > 1 else 0.0
    scores = 0.0 if machine.get("fused_attention") else 5 * h / tp * s * s
    activations = min(pp, n_micro) * layers * micro * (34 * s * d / tp + scores) * v / 2
    parts = {"compute": compute, "bubble": bubble, "tp": tp_time, "pp": pp_time, "dp": dp_time}
    return {"memory": state + gathered + activations, "time": sum(parts.values()), "parts": parts,
            "memory_parts": {"state": state, "gathered": gathered, "activations": activations}}


# --------------------------------------------------------------------------- calibration, here

def _measure(sizes, repeats):
    """Inside a rank: seconds of a 256^3 matmul (all ranks at once) and of all-reduces of `sizes` bytes."""
    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ a
    matmul = (time.perf_counter() - start) / repeats
    times = []
    for nbytes in sizes:
        t = torch.zeros(max(1, nbytes // 4))
        dist.all_reduce(t)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            dist.all_reduce(t)
        times.append((time.perf_counter() - start) / repeats)
    return matmul, times


def calibrate(world_size=8, repeats=5, small=64, large=16 << 20):
    """This machine as a cluster of `world_size` ranks on one node (all oversubscribed on its cores): FLOP/s
    per rank from a matmul every rank runs at once, alpha and beta from all-reduces of `small` and `large`
    bytes (a ring all-reduce: 2(N - 1) steps, 2(N - 1)/N x S bytes), float32 values."""
    results = launch(_measure, world_size, [small, large], repeats)
    matmul = sorted(r[0] for r in results)[len(results) // 2]
    t_small = sorted(r[1][0] for r in results)[len(results) // 2]
    t_large = sorted(r[1][1] for r in results)[len(results) // 2]
    steps, sent = ring_traffic(large, world_size)
    alpha = t_small / steps
    # the large all-reduce's time beyond its latency is its bytes at beta (at least half its time: a latency
    # measured on a loaded machine can exceed what the large one's steps waited)
    beta = sent / max(t_large - steps * alpha, t_large / 2)
    return dict(nodes=1, per_node=world_size, flops=2 * 256 ** 3 / matmul, memory=float("inf"),
                beta_intra=beta, beta_inter=beta, alpha=alpha, bytes_per_value=4, state_bytes=12,
                fused_attention=False)
