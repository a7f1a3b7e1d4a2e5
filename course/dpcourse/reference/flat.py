"""What a sharded training run must reproduce, seen as ZeRO sees a model: one flat vector.

ZeRO and FSDP concatenate the trainable parameters of a model (in `parameters()` order)
into one vector of S elements and give rank r the slice `chunk_bounds(S, N)[r]`. A
sharded run is right when every slice holds what one process training on the whole
global batches holds there: the parameters, the gradient of each step, the optimizer's
state (Adam's exp_avg and exp_avg_sq). `single_process_run` computes all of these in one
process, in float64, so a check can compare rank r's shard with elements [a, b) of the
reference -- and say which elements a wrong shard holds instead.

Used by notebook 10's checks (dpcourse.topics.zero.checks) and its hidden tests.
"""

import torch

from dpcourse.reference.gradients import state_of
from dpcourse.toys.data import global_batch
from dpcourse.toys.models import loss_fn


def trainable(params):
    """The parameters that take a gradient (requires_grad), in order: what ZeRO shards."""
    return [p for p in params if p.requires_grad]


def flat(tensors):
    """One 1-D tensor: the tensors flattened and concatenated in order (detached, on the CPU)."""
    tensors = [t.detach().cpu().reshape(-1) for t in tensors]
    return torch.cat(tensors) if tensors else torch.zeros(0)


def flat_state(optimizer, params, key):
    """The optimizer's per-parameter state `key` (e.g. "exp_avg") over `params`, as one flat vector."""
    return flat([optimizer.state[p][key] for p in params])


def adamw(model, lr=0.01):
    """The optimizer of notebook 10's checks: AdamW with its defaults and lr=0.01 (a function of the
    model, like reference.training.sgd)."""
    return torch.optim.AdamW(trainable(model.parameters()), lr=lr)


def single_process_run(make_model, X, Y, steps, global_size, make_optimizer=adamw):
    """Train make_model() in one process on `steps` whole global batches (rows step*B ... (step+1)*B-1).

    Returns a dict of plain tensors:
      "state":      the model's state_dict after training (state_of), names as in the model;
      "start":      the flat trainable parameters before training;
      "params":     the flat trainable parameters after training;
      "grads":      [the flat gradient of each step], the average over the global batch;
      "optimizer":  {key: flat state} for every per-parameter state tensor with one value per
                    parameter element (AdamW: exp_avg, exp_avg_sq);
      "names":      [(name, numel)] of the trainable parameters, in flat order.
    """
    model = make_model()
    params = trainable(model.parameters())
    start = flat(params)
    optimizer = make_optimizer(model)
    device = params[0].device
    grads = []
    for step in range(steps):
        xb, yb = global_batch(X, Y, step, global_size)
        optimizer.zero_grad()
        loss_fn(model(xb.to(device)), yb.to(device)).backward()
        grads.append(flat([p.grad for p in params]))
        optimizer.step()
    keys = [k for k, v in optimizer.state[params[0]].items()
            if isinstance(v, torch.Tensor) and v.shape == params[0].shape] if steps else []
    names = {p: name for name, p in model.named_parameters()}
    return {"state": state_of(model), "start": start, "params": flat(params), "grads": grads,
            "optimizer": {k: flat_state(optimizer, params, k) for k in keys},
            "names": [(names[p], p.numel()) for p in params]}


def element_name(names, index):
    """'fc0.weight[3]' for element `index` of the flat vector described by [(name, numel)]."""
    offset = 0
    for name, numel in names:
        if index < offset + numel:
            return f"{name}[{index - offset}]"
        offset += numel
    return f"element {index}"
