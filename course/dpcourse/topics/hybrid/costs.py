"""The course's cost model of a training step on a dp x pp x tp layout: predicted time and memory per GPU.

    predict(GPT_7B, cluster(nodes=32), dp=32, tp=8, pp=1, micro=4)
        # {"time": seconds, "memory": bytes, and the parts of each: "compute", "bubble", "tp_comm",
        #  "pp_comm", "dp_comm" (seconds), "state", "activations" (bytes)}

Why a module: notebook 09's planner compares layouts by a model small enough to state in a
few lines, built only from the formulas of earlier notebooks. With P parameters, L layers,
hidden size h, a heads, sequences of s tokens, a global batch of B sequences, e = 2 bytes per
value (fp16; `bytes_per_value` in the model), on N = dp·tp·pp GPUs of F FLOP/s each, m micro-batches
of b = B/(dp·m) sequences:
  compute  per micro-batch and stage: c = k·(P/pp)·b·s / (tp·F), k = 6 FLOPs per parameter and
           token (2 forward, 4 backward; 8 with activation recomputation, one more forward)
  tp       per micro-batch and stage: (L/pp) · 4 ring all-reduces (`tp_all_reduces` in the model) of
           b·s·h·e bytes over tp
           (notebook 08: g and f around attention and around the MLP)
  pp       per micro-batch and stage (pp > 1): one activation sent forward and one gradient
           back, alpha + b·s·h·e/beta each (notebook 07)
  pipeline (m + pp - 1) · (c + tp + pp): the 1F1B/GPipe bubble (pp - 1)/(m + pp - 1)
  layouts  dp·tp·pp = N; pp divides L, dp·m divides B, and tp divides h and a (each tp rank takes
           h/tp features and a/tp whole heads, as the course's and Megatron-LM's layers require)
  dp       one ring all-reduce of the GPU's gradients, e·P/(tp·pp) bytes, over dp, after the
           pipeline (no overlap); ZeRO-3 sends 1.5 times that (a reduce-scatter of the gradients
           and an all-gather of the weights in forward and again in backward)
  time     pipeline + dp
  memory   the ZeRO paper's 16 bytes per parameter of mixed-precision Adam (fp16 weights and
           gradients, fp32 master weights, momentum and variance), over the P/(tp·pp) parameters a
           GPU holds (sharded over dp by ZeRO-1/2/3), plus activations: stage 0 of 1F1B holds
           min(m, pp) micro-batches of L/pp layers, each layer keeping s·b·h·(10 + 24/tp +
           5·a·s/(h·tp)) bytes (Korthikanti et al. 2022, eq. 2), or only its input, 2·s·b·h
           bytes, with activation recomputation.
A ring all-reduce of S bytes over n ranks takes 2(n - 1)·(alpha + S/(n·beta)) (notebook 04).
An axis's groups use NVLink when they fit inside one node, the network otherwise: ranks are
laid out as torch.arange(N).view(dp, pp, tp), so a tp group spans tp consecutive ranks, a
pipeline tp·pp, and the dp groups the whole job; a group stays in a node when its span
divides the GPUs per node.
Ignored, on purpose: the embedding and the output layer, attention's s/(6h) share of the
FLOPs, overlap of communication with computation, and the repeated forward all-reduces of
recomputation. Used by notebook 09 (its planner exercise, its widget and its written answer).
"""

from dpcourse.comm.volume import predicted_time
from dpcourse.reference.memory import model_state_bytes
from dpcourse.toys.clusters import gpus, link

ZERO_STAGES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}

# Models: P, L, h, heads, s; batch = the global batch in sequences.
BERT_LARGE = dict(name="BERT-large", params=340e6, layers=24, hidden=1024, heads=16, seq=512, batch=4096,
                  recompute=False)
GPT_1_3B = dict(name="GPT 1.3B", params=1.3e9, layers=24, hidden=2048, heads=16, seq=2048, batch=512,
                recompute=False)
GPT_7B = dict(name="GPT 7B", params=6.7e9, layers=32, hidden=4096, heads=32, seq=2048, batch=512,
              recompute=True)
GPT_175B = dict(name="GPT-3 175B", params=175e9, layers=96, hidden=12288, heads=96, seq=2048, batch=1536,
                recompute=True)
MODELS = {m["name"]: m for m in (BERT_LARGE, GPT_1_3B, GPT_7B, GPT_175B)}


def check_layout(model, cluster, dp, tp, pp, micro):
    """A ValueError naming the rule a layout breaks (every GPU used, whole layers per stage, whole
    sequences per micro-batch, whole heads and an equal share of the hidden features per tp rank)."""
    n = gpus(cluster)
    if min(dp, tp, pp, micro) < 1:
        raise ValueError(f"dp, tp, pp and micro must be at least 1, got {dp}, {tp}, {pp}, {micro}")
    if dp * tp * pp != n:
        raise ValueError(f"dp {dp} x tp {tp} x pp {pp} = {dp * tp * pp} GPUs, the cluster has {n}")
    if model["layers"] % pp:
        raise ValueError(f"{model['layers']} layers do not split evenly into {pp} stages")
    if tp_splits(model, tp) is not None:
        raise ValueError(tp_splits(model, tp))
    if model["batch"] % (dp * micro):
        raise ValueError(f"a batch of {model['batch']} sequences does not split into dp {dp} x {micro} "
                         f"micro-batches")


def tp_splits(model, tp):
    """None when tp ranks can share the model's layers evenly, else why not: tensor parallelism gives
    each rank hidden/tp features and heads/tp whole attention heads (notebooks 08 and 09)."""
    if model["hidden"] % tp:
        return f"a hidden size of {model['hidden']} does not split evenly over tp {tp}"
    if model["heads"] and model["heads"] % tp:  # heads = 0: a model without attention
        return f"{model['heads']} attention heads do not split evenly over tp {tp}"
    return None


def activation_bytes(model, micro_batch, tp):
    """Bytes one layer keeps for its backward, per micro-batch of `micro_batch` sequences."""
    s, b, h, a = model["seq"], micro_batch, model["hidden"], model["heads"]
    if model.get("recompute"):
        return 2 * s * b * h
    return s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))


def predict(model, cluster, dp, tp, pp, micro, zero=0, overlap=False):
    """Predicted seconds per step and bytes per GPU of a layout (see the module docstring).

    zero: 0 (plain data parallelism) or the ZeRO stage 1, 2, 3 applied over dp. overlap=True lets
    the dp all-reduce hide behind the backward of the last micro-batch (2/3 of its compute), as
    DDP's buckets do (notebook 05); the planner's default is no overlap.
    """
    check_layout(model, cluster, dp, tp, pp, micro)
    e, b = model.get("bytes_per_value", 2), model["batch"] // (dp * micro)
    flops_per_token = 8 if model.get("recompute") else 6
    compute = flops_per_token * model["params"] / pp * b * model["seq"] / (tp * cluster["flops"])
    activation = b * model["seq"] * model["hidden"] * e
    layers = model["layers"] // pp
    tp_time = layers * model.get("tp_all_reduces", 4) * predicted_time("ring", activation, tp,
                                                                       *link(cluster, tp))
    alpha, beta = link(cluster, tp * pp)
    pp_time = 2 * (alpha + activation / beta) if pp > 1 else 0.0
    per_micro = compute + tp_time + pp_time
    gradients = e * model["params"] / (tp * pp)
    dp_time = predicted_time("ring", gradients, dp, *link(cluster, tp * pp * dp))
    if zero == 3:
        dp_time *= 1.5
    if overlap:
        dp_time = max(0.0, dp_time - 2 / 3 * compute)
    state = sum(model_state_bytes(model["params"] / (tp * pp), dp, ZERO_STAGES[zero]).values())
    held = layers * min(micro, pp) * activation_bytes(model, b, tp)
    return {"time": (micro + pp - 1) * per_micro + dp_time, "memory": state + held,
            "compute": micro * compute, "tp_comm": micro * tp_time, "pp_comm": micro * pp_time,
            "bubble": (pp - 1) * per_micro, "dp_comm": dp_time, "state": state, "activations": held}


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(model, cluster):
    """Every (dp, tp, pp, micro) the cost model accepts on the cluster: dp·tp·pp = its GPUs, pp
    divides the layers, dp the batch, micro the rows of one replica, tp the hidden size and the
    heads. What a brute-force search (the grader's best layout, the least memory any layout needs)
    walks through."""
    n = gpus(cluster)
    for dp in divisors(n):
        for tp in divisors(n // dp):
            pp = n // (dp * tp)
            if model["layers"] % pp or model["batch"] % dp or tp_splits(model, tp) is not None:
                continue
            for micro in divisors(model["batch"] // dp):
                yield dp, tp, pp, micro


def fastest(model, cluster, overlap=False):
    """The fastest layout that fits (every layout tried), as predict's dict with dp, tp, pp, micro;
    None when none fits."""
    best = None
    for dp, tp, pp, micro in layouts(model, cluster):
        p = predict(model, cluster, dp, tp, pp, micro, overlap=overlap)
        if p["memory"] <= cluster["memory"] and (best is None or p["time"] < best["time"]):
            best = dict(p, dp=dp, tp=tp, pp=pp, micro=micro)
    return best


def format_layout(p):
    return f"dp {p['dp']} x tp {p['tp']} x pp {p['pp']}, {p['micro']} micro-batch(es)"
