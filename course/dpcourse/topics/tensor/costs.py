"""What tensor and data parallelism send per transformer layer: formulas, next to what a run recorded.

    traffic = layer_traffic(batch=8, seq=1024, d_model=3072, tp=8, dp=64, element_size=2)
    print_layer_traffic(traffic)
    print_measured_vs_formula(steps, tokens=12, d_model=8, element_size=8, tp=2)

Tensor parallelism (Megatron-LM) all-reduces *activations*: per layer, g after attention and
g after the MLP in forward, f before each of them in backward -- four all-reduces of the
tokens x d_model tensor a layer reads and writes, S = b·s·h·e bytes, each on the critical
path (the next matmul needs its result). Data parallelism all-reduces *gradients*: once per
step, the layer's parameters (12·h² for attention and MLP, up to biases and norms; 1/T of
them per GPU when the layer is also split T ways), overlappable with backward. A ring
all-reduce of S bytes on N ranks sends 2(N - 1)/N · S per rank (notebook 04).
Used by notebook 08 (its written answer and the measurement of your MLP's traffic).
"""

from dpcourse.comm.volume import ring_traffic


def layer_traffic(batch, seq, d_model, tp, dp, element_size=2):
    """Per transformer layer and GPU: tensor-parallel traffic per micro-batch of `batch` sequences,
    data-parallel traffic per training step."""
    activation = batch * seq * d_model * element_size  # S: one all-reduce of tensor parallelism
    params_per_gpu = 12 * d_model ** 2 / tp            # attention 4h², MLP 8h² (d_hidden = 4h)
    gradients = params_per_gpu * element_size
    return {
        "tp_all_reduces": 4, "tp_all_reduce_bytes": activation,
        "tp_bytes_sent": 4 * ring_traffic(activation, tp)[1],
        "dp_all_reduce_bytes": gradients, "dp_bytes_sent": ring_traffic(gradients, dp)[1],
    }


def print_layer_traffic(t):
    """The two columns of layer_traffic, in MB."""
    mb = 1e6
    print(f"tensor parallel: {t['tp_all_reduces']} all-reduces of {t['tp_all_reduce_bytes'] / mb:.1f} MB per "
          f"layer and micro-batch, {t['tp_bytes_sent'] / mb:.1f} MB sent per GPU, on the critical path")
    print(f"data parallel:   1 all-reduce of {t['dp_all_reduce_bytes'] / mb:.1f} MB of gradients per layer "
          f"and step, {t['dp_bytes_sent'] / mb:.1f} MB sent per GPU, overlappable with backward")


def measured_traffic(steps):
    """[(direction, op, count, bytes)] summed over the recorded (forward ops, backward ops) of one step."""
    rows = []
    for direction, ops in zip(("forward", "backward"), steps, strict=True):
        counts = {}
        for o in ops:
            n, b = counts.get(o.op, (0, 0))
            counts[o.op] = (n + 1, b + o.nbytes)
        rows += [(direction, op, n, b) for op, (n, b) in counts.items()] or [(direction, "-", 0, 0)]
    return rows


def print_measured_vs_formula(step, tokens, d_model, element_size, tp):
    """The recorded collectives of one MLP step next to the formula: one all-reduce of
    tokens x d_model x element_size bytes each way, 2(T - 1)/T of it sent per rank."""
    formula = tokens * d_model * element_size
    print(f"{'direction':>9} {'collective':>12} {'count':>6} {'bytes handed':>13} {'formula':>8}   "
          f"{'sent per rank (ring)':>20}")
    for direction, op, count, nbytes in measured_traffic(step):
        print(f"{direction:>9} {op:>12} {count:>6} {nbytes:>13} {formula:>8}   "
              f"{ring_traffic(nbytes, tp)[1]:>20.0f}")
    print(f"formula: one all-reduce of tokens x d_model x {element_size} B = {tokens} x {d_model} x "
          f"{element_size} = {formula} B per direction; a ring sends 2(T - 1)/T of it = "
          f"{ring_traffic(formula, tp)[1]:.0f} B per rank at T = {tp}")
