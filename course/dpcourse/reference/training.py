"""The yardstick for a DDP training run: one process training on the same global batches.

Used by notebooks 05 (train_single_process, through checks.training) and 06
(single_process_training), and by their hidden checks.

Data-parallel training with N ranks, a DistributedSampler and a per-rank batch
of B / N is, step for step, the same computation as one process training on
batches of B -- if every rank does its part right. So a DDP run is checked by
replaying it in one process:

  * `sampler_orders` asks torch's own DistributedSampler (one per virtual rank,
    no process group needed) which samples each rank takes in an epoch;
  * `global_order` interleaves them back: global batch k of the DDP run is the
    slice [k*B, (k+1)*B) of that order, padding included;
  * `single_process_training` trains on those batches with the same seed,
    optimizer and loss, and reports the epoch losses the ranks must agree on.

The `expect_*` functions compare a run with it and say what went wrong in the
words a learner can act on ("call sampler.set_epoch(epoch)", "rank 1 wrote the
checkpoint"), not just "not equal".
"""

import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from dpcourse.toys.data import global_batch
from dpcourse.toys.models import loss_fn

MOMENTUM = 0.9


def sampler_orders(n, world_size, seed, epoch):
    """The sample indices DistributedSampler(shuffle=True, seed=seed) gives each rank in `epoch`."""
    orders = []
    for rank in range(world_size):
        sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=True,
                                     seed=seed)
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    return orders


def global_order(n, world_size, seed, epoch):
    """The epoch's samples in the order the N ranks' batches cover them together."""
    orders = sampler_orders(n, world_size, seed, epoch)
    return [orders[rank][k] for k in range(len(orders[0])) for rank in range(world_size)]


def single_process_training(make_model, dataset, *, epochs, global_batch, lr, seed, world_size):
    """Train make_model() in this process on the global batches N ranks would see together.

    Notebook 06's yardstick: SGD with momentum, cross-entropy, DistributedSampler's order.
    Returns {"model": state_dict, "losses": {epoch: mean loss over the epoch's samples},
    "optimizer": optimizer state_dict}. Losses are accumulated in float64.
    """
    if global_batch % world_size:
        raise ValueError(f"the global batch {global_batch} does not split over {world_size} ranks")
    torch.manual_seed(seed)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)
    losses = {}
    for epoch in range(epochs):
        order = global_order(len(dataset), world_size, seed, epoch)
        batches = [order[start:start + global_batch] for start in range(0, len(order), global_batch)]
        batch_losses = train_steps(model, ((dataset.images[b], dataset.labels[b]) for b in batches),
                                   F.cross_entropy, optimizer)
        total = 0.0
        for loss, batch in zip(batch_losses, batches, strict=True):
            total += loss * len(batch)
        losses[epoch] = total / len(order)
    return {"model": model.state_dict(), "losses": losses, "optimizer": optimizer.state_dict()}


def strip_module_prefix(state):
    """A DDP-wrapped model's state_dict names every entry 'module.<name>': compare the names."""
    return {(k[len("module."):] if k.startswith("module.") else k): v for k, v in state.items()}


def sgd(model, lr=0.1):
    """The optimizer of the checks: plain SGD (momentum would hide nothing, and adds nothing)."""
    return torch.optim.SGD(model.parameters(), lr=lr)


def train_single_process(model, X, Y, steps, global_size, make_optimizer=sgd):
    """Notebook 05's yardstick: `steps` optimizer steps on whole global batches (rows step*B ...
    (step+1)*B - 1), the course's mean squared error. Returns the model."""
    device = next(model.parameters()).device
    batches = ((xb.to(device), yb.to(device)) for xb, yb in
               (global_batch(X, Y, step, global_size) for step in range(steps)))
    train_steps(model, batches, loss_fn, make_optimizer(model))
    return model


def train_steps(model, batches, loss_fn, optimizer):
    """The one single-process training loop: one step per (x, y) in `batches`; returns each batch's loss.

    `optimizer` is a torch optimizer over the model's parameters (zero_grad, backward, step), or
    a learning rate: plain SGD written out, p -= lr * grad, as notebook 01's learners write it
    (bit for bit what they compute, which an optimizer's fused update is not).
    """
    losses = []
    params = list(model.parameters())
    for x, y in batches:
        loss = loss_fn(model(x), y)
        if isinstance(optimizer, (int, float)):
            grads = torch.autograd.grad(loss, params)
            with torch.no_grad():
                for p, g in zip(params, grads, strict=True):
                    p -= optimizer * g
        else:
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        losses.append(loss.item())
    return losses
