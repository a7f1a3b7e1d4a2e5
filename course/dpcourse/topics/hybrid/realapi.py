"""torch's own data x tensor parallelism on notebook 09's model, next to a learner's `hybrid_dp_tp_step`.

    case = dict(grid=(2, 2), model=dict(blocks=2, seed=1), lr=0.2, batches=[(x, y), ...])
    print_side_by_side(case, hybrid_dp_tp_step)     # both against one float64 process

Why: the notebook builds its grid and its hybrid step by hand; torch does the same with one
DeviceMesh (init_device_mesh, torch/distributed/device_mesh.py), `parallelize_module` on
mesh["tp"] (ColwiseParallel fc1, RowwiseParallel fc2: Megatron's f and g, notebook 08) and
FSDP2's `fully_shard(model, mesh=mesh["dp"])` over the replicas (notebook 10), which
reduce-scatters the gradients over dp and averages them. Both runs train the same float64
model on the same global batches, and both are compared with one process. FSDP2 combined with
tensor parallelism prints a UserWarning and a redistribute log line on CPU (FINDINGS.md):
silenced on purpose here (`quiet_dtensor`). Used by notebook 09 (section 4).
"""

from collections import Counter

import torch
import torch.distributed as dist
from torch.nn.functional import mse_loss

from dpcourse.comm.recorder import CommRecorder
from dpcourse.runtime.launcher import launch
from dpcourse.topics.hybrid.checks import reference_training
from dpcourse.topics.hybrid.grid import mesh_grid
from dpcourse.topics.hybrid.models import Residual, dp_tp_model
from dpcourse.topics.hybrid.runs import raise_failure, run_dp_tp_cases
from dpcourse.topics.tensor.realapi import parallelize_mlp, quiet_dtensor


def torch_dp_tp_training(case):
    """Inside a rank: the case's model trained with torch's API on a (dp, tp) mesh; per step the
    replica's loss and the collectives by group; at the end every full parameter."""
    dp, tp = case["grid"]
    from torch.distributed.fsdp import fully_shard

    _, mesh = mesh_grid(dp, tp=tp, pp=1)
    model = dp_tp_model(**case["model"])
    with quiet_dtensor():
        for layer in model:
            if isinstance(layer, Residual):
                layer.block = parallelize_mlp(layer.block, mesh["tp"])
        fully_shard(model, mesh=mesh["dp"])
        optimizer = torch.optim.SGD(model.parameters(), lr=case["lr"])
        losses, calls = [], []
        replica = mesh.get_coordinate()[0]
        for x, y in case["batches"]:
            with CommRecorder() as recorder:
                loss = mse_loss(model(x.tensor_split(dp)[replica]), y.tensor_split(dp)[replica])
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.detach().item())
            calls.append([[o.op, list(o.group) if o.group else None] for o in recorder.ops])
        params = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}
    return {"losses": losses, "calls": calls, "params": params, "rank": dist.get_rank()}


def _max_error(params, reference):
    return max((params[name].double() - want).abs().max().item() for name, want in reference.items())


def _full_params(case_runs, case):
    """The learner's full parameters after the last step, put together from the tp ranks of replica 0."""
    from dpcourse.topics.hybrid.models import placement

    dp, tp = case["grid"]
    ranks = [run for run in case_runs if run.rank < tp]             # replica 0: ranks 0 .. tp - 1
    last = [run.params[-1] for run in ranks]
    full = {}
    for name in last[0]:
        kind = placement(name)
        pieces = [p[name] for p in last]
        full[name] = (pieces[0] if kind == "replicated" else
                      torch.cat(pieces, dim=0 if kind == "column" else 1))
    return full


def print_side_by_side(case, step):
    """Train the case with the learner's step and with torch's API; print each one's largest
    parameter error against one float64 process, and the collectives torch ran, by group."""
    dp, tp = case["grid"]
    one = reference_training(dp_tp_model(**case["model"]), case["batches"], case["lr"], dp)
    reference = one["params"][-1]
    runs = run_dp_tp_cases(step, [case])[0]
    raise_failure(runs)
    yours = _full_params(runs, case)
    rows = launch(torch_dp_tp_training, dp * tp, case)
    steps = len(case["batches"])
    print(f"{dp} x {tp} (dp x tp), {case['model'].get('blocks', 1)} block(s), {steps} SGD steps, float64; "
          "largest parameter error against one process:")
    print(f"  {'yours (hybrid_dp_tp_step)':<70}{_max_error(yours, reference):.1e}")
    print(f"  {'torch (parallelize_module on mesh[tp], fully_shard on mesh[dp])':<70}"
          f"{_max_error(rows[0]['params'], reference):.1e}")
    counts = Counter((op, tuple(group) if group else None) for op, group in rows[0]["calls"][0])
    print("torch's collectives on rank 0 in step 1: " +
          ", ".join(f"{n} x {op} on {group}" for (op, group), n in counts.items()))
    return rows
