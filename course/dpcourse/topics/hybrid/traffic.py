"""Bytes each rank sends per training step on a grid, by group: the formulas notebook 09 grades.

    dp_tp_bytes(case_model, batch_rows=8, dp=2, tp=2, element_size=8)
        # {"tp": ..., "dp": ...}: bytes one rank sends per step on its tp group and on its dp group
    dp_pp_bytes(width=6, stage_params=84, batch_rows=8, dp=2, pp=2, n_micro=2, stage=0)
        # {"pp": ..., "dp": ...}

Both come from two formulas of earlier notebooks:
  * a ring all-reduce of S bytes over N ranks sends 2(N - 1)/N · S per rank (notebook 04);
  * a tensor-parallel block all-reduces the tokens x d_model activation once forward (g) and
    once backward (f), on the tp group (notebook 08);
  * a pipeline stage sends each micro-batch's activation to the next stage and its gradient to
    the previous one, rows x width values each (notebook 07).
Data x tensor, per rank and step, with b = B/dp rows per replica, e bytes per value, L blocks:
    tp group:  2L all-reduces of b·d_model·e bytes      ->  2L · 2(tp - 1)/tp · b·d_model·e
    dp group:  the gradients of its local parameters    ->  2(dp - 1)/dp · e · (local parameters)
Data x pipeline, per rank and step, stage s of p, m micro-batches of b/m rows:
    pp group:  m activations forward (s < p - 1), m gradients back (s > 0), (b/m)·width·e each
    dp group:  2(dp - 1)/dp · e · (the stage's parameters)
The bytes handed to each collective are the same whatever N; what N changes is how much of
them each rank sends. Used by notebook 09 (its tests and its traffic tables).
"""

from dpcourse.comm.volume import ring_bytes, ring_traffic
from dpcourse.topics.hybrid.grid import expected_grid


def local_parameters(d_in, d_model, d_hidden, d_out, blocks, tp, bias=True):
    """How many parameters one rank of a tp group holds of dp_tp_model: the input and output
    Linear whole, and 1/tp of each block's MLP (fc2's bias whole)."""
    b = 1 if bias else 0
    outer = d_in * d_model + b * d_model + d_model * d_out + b * d_out
    block = (d_model * d_hidden + b * d_hidden) // tp + (d_hidden * d_model) // tp + b * d_model
    return outer + blocks * block


def dp_tp_bytes(model, batch_rows, dp, tp, element_size=8):
    """{"tp": bytes, "dp": bytes} one rank sends per step of hybrid_dp_tp_step (`model`: the keyword
    arguments of dp_tp_model)."""
    rows = batch_rows // dp
    d_model, blocks = model.get("d_model", 8), model.get("blocks", 1)
    activation = rows * d_model * element_size
    n_local = local_parameters(model.get("d_in", 6), d_model, model.get("d_hidden", 16),
                               model.get("d_out", 3),
                               blocks, tp, model.get("bias", True))
    return {"tp": 2 * blocks * ring_traffic(activation, tp)[1],
            "dp": ring_traffic(n_local * element_size, dp)[1]}


def dp_pp_bytes(width, stage_params, batch_rows, dp, pp, n_micro, stage, element_size=8):
    """{"pp": bytes, "dp": bytes} one rank (stage `stage` of pp) sends per step of hybrid_dp_pp_step."""
    message = batch_rows // dp // n_micro * width * element_size
    messages = n_micro * ((stage < pp - 1) + (stage > 0))
    return {"pp": messages * message, "dp": ring_traffic(stage_params * element_size, dp)[1]}


def _sent(ops, group):

    if len(group) < 2:
        return 0.0
    return sum(ring_bytes(o) for o in ops if o.op != "send" and o.group and tuple(o.group) == tuple(group))


def print_dp_tp_traffic(case_runs, case):
    """Per rank, the bytes its first step sent on its tp and dp groups, next to dp_tp_bytes."""
    from dpcourse.topics.hybrid.runs import raise_failure

    raise_failure(case_runs)
    dp, tp = case["grid"]
    rows = len(case["batches"][0][0])
    formula = dp_tp_bytes(case["model"], rows, dp, tp)
    print(f"dp {dp} x tp {tp}, {rows} rows, d_model {case['model'].get('d_model', 8)}, "
          f"{case['model'].get('blocks', 1)} block(s), float64; bytes sent in step 1:")
    print(f"{'rank':>5} {'tp group':>14} {'sent':>8} {'formula':>8}   {'dp group':>14} {'sent':>9} "
          f"{'formula':>9}")
    for run, place in zip(case_runs, expected_grid(dp, tp), strict=True):
        tp_group, dp_group = place["members"]["tp"], place["members"]["dp"]
        ops = run.steps[0] if run.steps else []
        print(f"{run.rank:>5} {str(tuple(tp_group)):>14} {_sent(ops, tp_group):>8.0f} {formula['tp']:>8.0f} "
              "  "
              f"{str(tuple(dp_group)):>14} {_sent(ops, dp_group):>9.0f} {formula['dp']:>9.0f}")


def print_dp_pp_traffic(case_runs, case):
    """Per rank, the bytes its first step sent to its pipeline neighbours and on its dp group."""
    from dpcourse.topics.hybrid.models import dp_pp_model
    from dpcourse.topics.hybrid.runs import raise_failure

    raise_failure(case_runs)
    dp, pp = case["grid"]
    rows, width, cuts = len(case["batches"][0][0]), case["model"].get("width", 6), case["cuts"]
    model = dp_pp_model(**case["model"])
    print(f"dp {dp} x pp {pp}, {rows} rows, width {width}, m = {case['n_micro']}, float64; bytes sent in "
          "step 1:")
    print(f"{'rank':>5} {'stage':>5} {'pipeline':>10} {'sent':>7} {'formula':>8}   {'dp group':>10} "
          f"{'sent':>8} "
          f"{'formula':>8}")
    for run, place in zip(case_runs, expected_grid(dp, 1, pp), strict=True):
        stage = place["coords"]["pp"]
        n = sum(p.numel() for layer in model[cuts[stage]:cuts[stage + 1]] for p in layer.parameters())
        formula = dp_pp_bytes(width, n, rows, dp, pp, case["n_micro"], stage)
        ops = run.steps[0] if run.steps else []
        sent = sum(o.nbytes for o in ops if o.op == "send")
        dp_group = place["members"]["dp"]
        print(f"{run.rank:>5} {stage:>5} {str(tuple(place['members']['pp'])):>10} {sent:>7} "
              f"{formula['pp']:>8}   "
              f"{str(tuple(dp_group)):>10} {_sent(ops, dp_group):>8.0f} {formula['dp']:>8.0f}")
