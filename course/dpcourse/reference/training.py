"""The yardstick for a DDP training run: one process training on the same global batches.

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
        total = 0.0
        for start in range(0, len(order), global_batch):
            batch = order[start:start + global_batch]
            loss = F.cross_entropy(model(dataset.images[batch]), dataset.labels[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item() * len(batch)
        losses[epoch] = total / len(order)
    return {"model": model.state_dict(), "losses": losses, "optimizer": optimizer.state_dict()}


def strip_module_prefix(state):
    """A DDP-wrapped model's state_dict names every entry 'module.<name>': compare the names."""
    return {(k[len("module."):] if k.startswith("module.") else k): v for k, v in state.items()}


def sgd(model, lr=0.1):
    """The optimizer of the checks: plain SGD (momentum would hide nothing, and adds nothing)."""
    return torch.optim.SGD(model.parameters(), lr=lr)


def train_single_process(model, X, Y, steps, global_size, make_optimizer=sgd):
    """The reference: one process, `steps` optimizer steps on whole global batches. Returns the model."""
    opt = make_optimizer(model)
    device = next(model.parameters()).device
    for step in range(steps):
        xb, yb = global_batch(X, Y, step, global_size)
        opt.zero_grad()
        loss_fn(model(xb.to(device)), yb.to(device)).backward()
        opt.step()
    return model
