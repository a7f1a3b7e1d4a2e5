"""The yardstick for notebook 13: one process training the GPT on the same global batches and recipe.

Used by notebook 13's test cells, hidden checks, pictures and benchmark.

    recipe = Recipe(batch=8, lr=0.3, max_norm=1.0, warmup=2, total=20)
    batches = batches_of(samples, recipe, steps=4)          # the global batch of each step
    run = single_process_lm(config, seed=0, batches=batches, recipe=recipe)
    run["losses"], run["norms"], run["lrs"], run["params"]      # per step, and the parameters at the end

Every parallel layout of the same model is, step for step, this computation: step k's global batch is
`global_batch(len(data), recipe.batch, k, recipe.data_seed)` (an epoch is a permutation of the samples:
what torch's DistributedSampler(shuffle=True, seed) draws, torch/utils/data/distributed.py),
the loss is the mean cross-entropy over every position of it, the gradient norm is the norm of the whole
model's gradient (before clipping), the update is SGD with momentum on the clipped gradient, and the
learning rate follows a linear warm-up then a cosine decay (`Recipe.lr_at`). The recipe's optimizer and
schedule come from `make_optimizer`, which the ranks use too: what differs between a layout and this run is
only how the work is split.
"""

import math
from dataclasses import asdict, dataclass

import torch

from dpcourse.toys.gpt import gpt, lm_loss


@dataclass(frozen=True)
class Recipe:
    batch: int = 8  # sequences per step, over all data-parallel ranks
    lr: float = 0.3
    momentum: float = 0.9
    max_norm: float = 1.0  # global gradient-norm clipping
    warmup: int = 2  # steps of linear warm-up
    total: int = 20  # steps of the cosine decay's period (it reaches 10% of lr there)
    data_seed: int = 0

    def lr_at(self, step):
        """The learning rate of step `step` (0-based): linear warm-up to lr, then cosine down to lr / 10."""
        return self.lr * lr_factor(self, step)

    def as_dict(self):
        return asdict(self)


def lr_factor(recipe, step):
    if step < recipe.warmup:
        return (step + 1) / recipe.warmup
    progress = min(1.0, (step - recipe.warmup) / max(1, recipe.total - recipe.warmup))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(parameters, recipe):
    """(SGD with momentum, its LambdaLR schedule): what the reference and every rank step with."""
    optimizer = torch.optim.SGD(parameters, lr=recipe.lr, momentum=recipe.momentum)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(recipe, step))
    return optimizer, schedule


def global_batch(n_samples, batch, step, seed):
    """The sample indices of step `step`'s global batch: epochs are permutations of the n samples (a new one
    each epoch, from seed + epoch), cut into consecutive batches."""
    if n_samples % batch:
        raise ValueError(f"{n_samples} samples do not make whole batches of {batch}")
    per_epoch = n_samples // batch
    epoch, k = divmod(step, per_epoch)
    order = torch.randperm(n_samples, generator=torch.Generator().manual_seed(seed + epoch))
    return order[k * batch:(k + 1) * batch]


def batches_of(data, recipe, steps, first=0):
    """The global batches (sample rows) of steps first, first + 1, ... of `data` under the recipe."""
    return [data[global_batch(len(data), recipe.batch, k, recipe.data_seed)]
            for k in range(first, first + steps)]


def single_process_lm(config, seed, batches, recipe, dtype=torch.float64):
    """Train gpt(config, seed) in one process, one step per global batch; per step the loss, the gradient
    norm before clipping and the learning rate used; at the end the parameters (float64 copies)."""
    model = gpt(config, seed=seed, dtype=dtype)
    optimizer, schedule = make_optimizer(model.parameters(), recipe)
    losses, norms, lrs = [], [], []
    for rows in batches:
        loss = lm_loss(model(rows[:, :-1]), rows[:, 1:])
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.max_norm)))
        lrs.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    params = {name: p.detach().double().clone() for name, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "lrs": lrs, "params": params}
