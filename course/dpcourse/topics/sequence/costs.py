"""Memory and bytes per step of the ways to split a long sequence, and a planner that picks among them.

    activation_bytes(seq=131072, batch=1, hidden=4096, heads=32, tp=8, sp=True)   # one layer, bytes
    traffic("ring", seq=131072, batch=1, hidden=4096, ranks=8)                   # one layer, per GPU
    rows = long_context_plan(LLAMA_7B_128K, cluster(nodes=4))                     # every layout, costed
    print_plan(rows)

Why a module: notebook 12's written answer and its planner compare TP + SP, ring attention and
Ulysses (and expert parallelism's all-to-alls) with formulas small enough to state, built from
the collectives' costs of notebooks 04 and 09 and from the papers:

activations per layer, fp16, b sequences of s tokens, hidden h, a heads (Korthikanti et al. 2022,
  section 4): no parallelism s·b·h·(34 + 5·a·s/h) bytes; tensor parallelism over t GPUs
  s·b·h·(10 + 24/t + 5·a·s/(h·t)); with sequence parallelism s·b·h·(34/t + 5·a·s/(h·t)). The
  5·a·s/h term is the softmax's output (2·a·s²·b bytes), its dropout mask (a·s²·b) and the
  dropout's output (2·a·s²·b) (section 4.1: the raw scores QKᵀ are not kept); a fused attention
  kernel that does not keep them (FlashAttention) removes it (scores=False here). Splitting the sequence
  over c more GPUs (ring attention or Ulysses) divides every term by c: each GPU holds s/c tokens
  of everything (Ulysses holds all s tokens of h/c heads inside attention: the same bytes).
  Activation recomputation keeps only each layer's input, 2·s·b·h bytes, divided likewise.
bytes one GPU sends per layer, forward and backward, S = s·b·h·e (e bytes per value):
  TP + SP   4 all-gathers and 4 reduce-scatters of S over t: 8·(t - 1)/t·S (the bytes of TP's 4
            all-reduces, 2·(t - 1)/t·S each)
  ring      forward, N - 1 messages of K and V of one block, 2·S/N each (h_kv = h); backward, K
            and V travel again (N - 1) and dK, dV take N hops, exchanged at every step and the last
            one back to their owner (torch's `_templated_ring_attention_backward`: its dkv_rotater
            exchanges at each of the N steps): (3·N - 2)·2·S/N in all (5·S at N = 4)
  Ulysses   forward, all-to-alls of q, k, v (3·S/N of input) and of the output (S/N), of which a
            GPU sends (N - 1)/N; backward the same again: 8·(N - 1)/N·S/N in all
  experts   (MoE layer) dispatch and combine of the k·T·h·e bytes of a GPU's T tokens' k choices,
            forward and backward: 4·(N - 1)/N·k·T·h·e
time of a step: compute (6·P·tokens + 6·L·s²·h for causal attention, over the GPUs at F FLOP/s)
  plus communication at the link the group spans (NVLink inside a node, the network across),
  alpha per message and bytes/beta; nothing overlapped (ring attention can hide its messages
  behind each block's computation: `overlap` says whether they fit).
"""

import math

from dpcourse.comm.volume import all_to_all_traffic, ring_traffic
from dpcourse.toys.clusters import cluster, link  # noqa: F401 - cluster is part of this API

# A Llama-2-7B-shaped model (Touvron et al. 2023: 32 layers, hidden 4096, 32 heads, 6.7 B parameters)
# trained on sequences of 128 Ki tokens, one sequence per step.
LLAMA_7B_128K = dict(name="7B, 128k tokens", params=6.7e9, layers=32, hidden=4096, heads=32, seq=131072,
                     batch=1, recompute=False)
BYTES = 2  # fp16 / bf16 activations and messages


def activation_bytes(seq, batch, hidden, heads, tp=1, sp=False, cp=1, scores=False, recompute=False):
    """Bytes of activations one GPU keeps for backward, per layer (see the module docstring)."""
    sbh = seq * batch * hidden
    if recompute:
        return 2 * sbh / (tp if sp else 1) / cp
    attention = 5 * heads * seq / hidden / tp if scores else 0.0
    if sp:
        return sbh * (34 / tp + attention) / cp
    return sbh * (10 + 24 / tp + attention) / cp


def traffic(method, seq, batch, hidden, ranks, element_size=BYTES, k=1, tokens=None):
    """Bytes one GPU sends per layer, forward and backward, and the number of messages it sends."""
    n = ranks
    S = seq * batch * hidden * element_size
    if n == 1:
        return {"bytes": 0.0, "messages": 0}
    if method == "tp_sp":  # 4 all-gathers and 4 reduce-scatters of S: 8 ring phases
        messages, sent = ring_traffic(S, n, phases=8)
    elif method == "ring":  # K and V (2·S): N-1 hops forward and N-1 backward; dK, dV N hops backward
        # (passed on at every step, then home to their owner): (3N - 2) hops of 2S/N
        messages = 3 * n - 2 if n > 1 else 0
        sent = messages * 2 * S / n
    elif method == "ulysses":  # q, k, v and the output, forward and backward: 8·S/N through 4 all-to-alls
        messages, sent = all_to_all_traffic(8 * S / n, n, calls=4)
    elif method == "experts":  # dispatch and combine, forward and backward: 4 all-to-alls of k·T tokens
        T = seq * batch if tokens is None else tokens
        messages, sent = all_to_all_traffic(4 * k * T * hidden * element_size, n, calls=4)
    else:
        raise ValueError(f"unknown method {method!r}: tp_sp, ring, ulysses or experts")
    return {"bytes": sent, "messages": messages}


def seconds(nbytes, messages, alpha, beta):
    """Alpha-beta time of a rank's messages: alpha each, plus bytes over the bandwidth."""
    return messages * alpha + nbytes / beta


def _link(c, span):
    """(alpha, beta) of a group spanning `span` consecutive GPUs (toys.clusters.link's rule)."""
    return link(c, span)


def layout_cost(model, c, tp=1, cp=1, method="ring"):
    """One layout of a long-context step: tp-way TP + SP inside, cp-way context parallel (ring or Ulysses)
    around it, the rest data parallel. Returns a dict of memory (bytes per GPU) and time (seconds)."""
    s, b, h, a, L, P = (model[key] for key in ("seq", "batch", "hidden", "heads", "layers", "params"))
    state = 16 * P / tp  # mixed-precision Adam: 16 bytes per parameter, split by TP only (no ZeRO here)
    acts = L * activation_bytes(s, b, h, a, tp=tp, sp=tp > 1, cp=cp, recompute=model.get("recompute", False))
    tp_t = traffic("tp_sp", s // cp, b, h, tp)
    cp_t = traffic(method, s, b, h // tp, cp)  # each TP rank carries its h/t share of the heads
    alpha_tp, beta_tp = _link(c, tp)
    alpha_cp, beta_cp = _link(c, tp * cp)
    flops = 6 * P * s * b + 6 * L * s * s * h * b
    compute = flops / (tp * cp * c["flops"])
    comm_tp = L * seconds(tp_t["bytes"], tp_t["messages"], alpha_tp, beta_tp)
    comm_cp = L * seconds(cp_t["bytes"], cp_t["messages"], alpha_cp, beta_cp)
    possible = (s % cp == 0 and h % tp == 0 and a % tp == 0 and (method != "ulysses" or (a // tp) % cp == 0))
    return {"method": method if cp > 1 else "-", "tp": tp, "cp": cp, "state": state, "activations": acts,
            "memory": state + acts, "fits": possible and state + acts <= c["memory"], "possible": possible,
            "compute": compute, "tp_comm": comm_tp, "cp_comm": comm_cp, "time": compute + comm_tp + comm_cp,
            "tp_bytes": L * tp_t["bytes"], "cp_bytes": L * cp_t["bytes"],
            "overlap": method == "ring" and cp > 1 and comm_cp / cp_t["messages"] <= compute / (3 * cp)}


def long_context_plan(model, c, max_tp=8):
    """Every layout tp x cp (tp up to a node, powers of 2) with ring and Ulysses, fastest fitting first."""
    gpus = c["nodes"] * c["gpus_per_node"]
    rows = []
    tp = 1
    while tp <= min(max_tp, c["gpus_per_node"]):
        cp = 1
        while tp * cp <= gpus:
            for method in (("ring", "ulysses") if cp > 1 else ("ring",)):
                rows.append(layout_cost(model, c, tp=tp, cp=cp, method=method))
            cp *= 2
        tp *= 2
    rows.sort(key=lambda r: (not r["fits"], r["time"] if r["fits"] else r["memory"]))
    return rows


def print_plan(rows, limit=12):
    """The plan as a table (GB, seconds)."""
    print(f"{'layout':<24} {'GPUs':>5} {'state GB':>9} {'acts GB':>8} {'fits':>5} {'compute s':>10} "
          f"{'TP comm s':>10} {'CP comm s':>10} {'step s':>8}")
    for r in rows[:limit]:
        name = f"TP+SP {r['tp']}" + (f" x {r['method']} {r['cp']}" if r["cp"] > 1 else "")
        if not r["possible"]:
            name += " (-)"
        print(f"{name:<24} {r['tp'] * r['cp']:>5} {r['state'] / 1e9:>9.1f} {r['activations'] / 1e9:>8.1f} "
              f"{'yes' if r['fits'] else 'no':>5} {r['compute']:>10.2f} {r['tp_comm']:>10.3f} "
              f"{r['cp_comm']:>10.3f} "
              f"{r['time']:>8.2f}")


def expert_traffic(tokens, hidden, k, ranks, element_size=BYTES):
    """Bytes one GPU sends per MoE layer and step (dispatch and combine, forward and backward)."""
    return traffic("experts", tokens, 1, hidden, ranks, element_size, k=k, tokens=tokens)["bytes"]


def ring_vs_ulysses(seq, batch, hidden, ranks, element_size=BYTES):
    """Forward bytes per GPU of one attention layer: ring attention's and Ulysses', and their ratio N/2."""
    S = seq * batch * hidden * element_size
    n = ranks
    ring = (n - 1) * 2 * S / n
    ulysses = 4 * (n - 1) / n * S / n
    return {"ring": ring, "ulysses": ulysses, "ratio": ring / ulysses if ulysses else math.nan}
