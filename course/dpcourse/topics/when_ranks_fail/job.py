"""The training job of notebook 14, on ranks (`Trainer`) and in one process (`simulate`, the reference).

Used by every exercise of notebook 14 (its test cells, hidden checks, demos and benchmark), and by
`worker` (the same job under torchrun).

Why one job: checkpointing is about *everything* a run carries from one step to the next, so the job
carries one of each kind of state a real one does, each of which a resumed run gets wrong in its own
way when it is not saved:
  * parameters, replicated (every rank holds them, as under DDP);
  * AdamW's moments, **sharded** over the ranks (ZeRO-1, notebook 10): rank r keeps the moments of
    its piece of the flat parameter vector, held for checkpoints as DTensors (`Shard(0)` over a 1-D
    mesh), so that torch.distributed.checkpoint can load them at another world size;
  * the learning-rate schedule (warm-up then cosine, `LambdaLR`) and the step count;
  * the sampler's position in the epoch's shuffled order;
  * three random streams per rank: torch's global generator (dropout), the trainer's own generator
    (noise added to the inputs) and Python's `random` (how strong that noise is, each step).

Every rank's step is: next batch -> noisy inputs -> forward (dropout) -> backward -> gradients
all-reduced (averaged) -> AdamW on the rank's piece -> pieces all-gathered -> schedule stepped.
Faults (`faults=[{"step", "where", "kind", ...}]`, one rank's list) fire at named places of a step:
`PHASES`, plus "start" (before anything) and "end" (after the step).

`simulate` runs the same job for N ranks in one process: each rank's batch, random streams and
gradient in turn, the gradients summed in rank order and averaged, AdamW on the whole vector (an
elementwise update: the same numbers as on pieces). It is the independent reference of the checks:
float64, equal to the ranks' run up to the order of the all-reduce's additions (~1e-16).
"""

import math
import os
import random
import signal
import time
import zlib
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from dpcourse.reference.splits import ceil_div
from dpcourse.toys.data import smooth_regression_data

# The places of a step, in order (a heartbeat names one; a fault fires at one).
PHASES = ("data", "forward", "backward", "all_reduce", "optimizer")

JOB = dict(
    samples=48,  # data set size
    features=6,
    hidden=16,
    outputs=2,
    dropout=0.1,
    noise=0.05,  # inputs get noise * (1 + random.random()) * N(0, 1) (0: no augmentation)
    global_batch=12,  # samples per step over all ranks
    lr=0.02,
    warmup=2,  # steps of linear warm-up, then cosine decay to 10% over `steps`
    weight_decay=0.01,
    steps=8,
    seed=0,  # model, shuffles and every rank's random streams
    data_seed=1,
    layout="sharded",  # AdamW's moments: "sharded" over the ranks (ZeRO-1) or "replicated"
)


def make_job(**changes):
    """JOB with some entries changed; unknown names are refused (a typo would be silently ignored)."""
    unknown = sorted(set(changes) - set(JOB))
    if unknown:
        raise ValueError(f"unknown job settings {unknown}: the job has {sorted(JOB)}")
    return dict(JOB, **changes)


def build_model(job):
    """The job's MLP (Linear -> Tanh -> Dropout -> Linear, float64), the same from the same seed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(job["seed"])
        return nn.Sequential(nn.Linear(job["features"], job["hidden"]), nn.Tanh(),
                             nn.Dropout(job["dropout"]), nn.Linear(job["hidden"], job["outputs"])).double()


def job_data(job):
    """(x, y) of the job's data set: float64, generated from data_seed."""
    return smooth_regression_data(job["samples"], job["features"], job["outputs"], seed=job["data_seed"])


def lr_factor(step, warmup, steps):
    """The schedule's multiplier of the base learning rate at `step`: linear warm-up, then cosine to 0.1."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))


def rank_seeds(job, rank):
    """The seeds of rank `rank`'s three random streams: torch's (dropout), the trainer's generator
    (input noise), Python's random (noise strength)."""
    base = 1000 * (job["seed"] + 1) + 7 * rank
    return {"torch": base + 1, "generator": base + 2, "python": base + 3}


def shard_bounds(numel, world_size):
    """[(start, stop)] of each rank's piece of a flat vector: torch.chunk's split, the one DTensor's
    Shard(0) uses (pieces of ⌈numel / N⌉, the last ones shorter or empty)."""
    size = ceil_div(numel, world_size)
    return [(min(r * size, numel), min((r + 1) * size, numel)) for r in range(world_size)]


def epoch_order(samples, seed, epoch):
    """The shuffled order of one epoch: the same on every rank (seeded by seed + epoch, as
    DistributedSampler does)."""
    return torch.randperm(samples, generator=torch.Generator().manual_seed(seed + epoch))


class ShardSampler:
    """The course's sampler, DistributedSampler's way: each epoch's order dealt like cards (rank r takes
    positions r, r + N, ...), and each step the next global_batch / N of the rank's shard.

    Its state (`state_dict`) is the epoch and the position **in this rank's shard**: it resumes exactly
    at the same world size, and not at another one (position 9 of a shard of 3 ranks is not where
    position 9 of a shard of 4 ranks was). An epoch is samples // global_batch steps."""

    def __init__(self, samples, global_batch, seed, rank, world_size):
        if global_batch % world_size:
            raise ValueError(f"a global batch of {global_batch} does not split over {world_size} ranks")
        self.samples, self.global_batch, self.seed = samples, global_batch, seed
        self.rank, self.world_size = rank, world_size
        self.per_rank = global_batch // world_size
        self.epoch, self.position = 0, 0

    def next_batch(self):
        if (self.position + self.per_rank) * self.world_size > self.samples:
            self.epoch, self.position = self.epoch + 1, 0
        shard = epoch_order(self.samples, self.seed, self.epoch)[self.rank::self.world_size]
        batch = shard[self.position:self.position + self.per_rank]
        self.position += self.per_rank
        return batch

    def state_dict(self):
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state):
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def global_stream(job, steps, start=0):
    """The samples of global steps start .. steps - 1, in epoch order: what any world size must train on
    (each epoch is samples // global_batch batches of the shuffled order; the rest waits for no one)."""
    per_epoch = job["samples"] // job["global_batch"]
    out = []
    for step in range(start, steps):
        epoch, index = divmod(step, per_epoch)
        order = epoch_order(job["samples"], job["seed"], epoch)
        out.append(order[index * job["global_batch"]:(index + 1) * job["global_batch"]].tolist())
    return out


class ShardedAdamW(torch.optim.Optimizer):
    """AdamW whose moments are sharded over the ranks (ZeRO-1): rank r updates its piece of the flat
    parameter vector, then the pieces are all-gathered. Gradients must already be averaged.

    state_dict(): {"exp_avg", "exp_avg_sq": DTensors (Shard(0) over `mesh`) or, replicated, whole tensors;
    "steps": AdamW's step count; "lr": the learning rate the schedule last set}. load_state_dict takes
    the same, with this optimizer's layout (a DTensor is read through to_local())."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, mesh=None, group=None):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.flat_params = [p for g in self.param_groups for p in g["params"]]
        self.numel = sum(p.numel() for p in self.flat_params)
        self.mesh, self.group = mesh, group
        self.world_size = dist.get_world_size(group) if mesh is not None else 1
        rank = dist.get_rank(group) if mesh is not None else 0
        self.bounds = shard_bounds(self.numel, self.world_size)[rank]
        size = self.bounds[1] - self.bounds[0]
        dtype = self.flat_params[0].dtype
        self.exp_avg = torch.zeros(size, dtype=dtype)
        self.exp_avg_sq = torch.zeros(size, dtype=dtype)
        self.steps = 0

    @torch.no_grad()
    def step(self, closure=None):
        group = self.param_groups[0]
        lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        lo, hi = self.bounds
        flat = parameters_to_vector(self.flat_params)
        grad = torch.cat([p.grad.reshape(-1) for p in self.flat_params])[lo:hi]
        piece = flat[lo:hi].clone()
        self.steps += 1
        piece.mul_(1 - lr * decay)
        self.exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (self.exp_avg_sq / (1 - beta2 ** self.steps)).sqrt().add_(eps)
        piece.addcdiv_(self.exp_avg, denom, value=-lr / (1 - beta1 ** self.steps))
        if self.world_size > 1:
            size = ceil_div(self.numel, self.world_size)
            padded = torch.zeros(size, dtype=piece.dtype)
            padded[:piece.numel()] = piece
            pieces = [torch.empty_like(padded) for _ in range(self.world_size)]
            dist.all_gather(pieces, padded, group=self.group)
            piece = torch.cat(pieces)[:self.numel]
        vector_to_parameters(piece, self.flat_params)

    def _held(self, local):
        if self.mesh is None:
            return local
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False,
                                  shape=torch.Size([self.numel]), stride=(1,))

    def state_dict(self):
        return {"exp_avg": self._held(self.exp_avg), "exp_avg_sq": self._held(self.exp_avg_sq),
                "steps": self.steps, "lr": self.param_groups[0]["lr"]}

    def load_state_dict(self, state):
        for name in ("exp_avg", "exp_avg_sq"):
            value = state[name]
            local = value.to_local() if hasattr(value, "to_local") else value
            if local.numel() == self.numel and self.numel != getattr(self, name).numel():
                local = local[self.bounds[0]:self.bounds[1]]  # a whole vector: take this rank's piece
            if local.shape != getattr(self, name).shape:
                raise ValueError(f"{name}: a piece of shape {tuple(local.shape)} for this rank's piece of "
                                 f"{getattr(self, name).numel()} values (elements {self.bounds[0]} to "
                                 f"{self.bounds[1]} of {self.numel})")
            getattr(self, name).copy_(local)
        self.steps = int(state["steps"])
        self.param_groups[0]["lr"] = float(state["lr"])


class Fault(Exception):
    """Raised on ranks where an injected fault ends the step (a hang released, a step skipped)."""


class Trainer:
    """One rank's training job (see the module docstring). The attributes a checkpoint is made of:
    model, optimizer (ShardedAdamW), scheduler (LambdaLR), sampler, step, generator; and the two global
    random streams, torch's and Python's.

        trainer = Trainer(job)
        trainer.train_step()              # one step: local_step() then sync_step()
        trainer.report()                  # {"losses": {step: float}, "seen": {step: [indices]}, ...}
    """

    def __init__(self, job, sampler=ShardSampler, faults=(), group=None, beat=None):
        self.job, self.group, self.beat_hook = dict(job), group, beat
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.faults = [dict(f) for f in faults]
        self.fired, self.step = [], 0
        self._fault("start")
        self.model = build_model(job).train()
        seeds = rank_seeds(job, self.rank)
        torch.manual_seed(seeds["torch"])
        random.seed(seeds["python"])
        self.generator = torch.Generator().manual_seed(seeds["generator"])
        self.mesh = None
        if job["layout"] == "sharded":
            self.mesh = rank_mesh(self.world_size, group)
        self.optimizer = ShardedAdamW(self.model.parameters(), lr=job["lr"], weight_decay=job["weight_decay"],
                                      mesh=self.mesh, group=group)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, partial(lr_factor, warmup=job["warmup"], steps=job["steps"]))
        self.sampler = sampler(job["samples"], job["global_batch"], job["seed"], self.rank, self.world_size)
        self.x, self.y = job_data(job)
        self.losses, self.seen, self.lrs, self.draws, self.skipped = {}, {}, {}, {}, []
        self.loss = None

    # -- one step ---------------------------------------------------------------------------------
    def train_step(self):
        self.local_step()
        self.sync_step()

    def local_step(self):
        """Data, noise, forward, backward: everything of a step that needs no other rank."""
        self.draw = random_fingerprints(self.generator)
        self._at("data")
        batch = torch.as_tensor(self.sampler.next_batch(), dtype=torch.long)
        x, y = self.x[batch], self.y[batch]
        if self.job["noise"]:
            strength = self.job["noise"] * (1.0 + random.random())
            x = x + strength * torch.randn(x.shape, generator=self.generator, dtype=x.dtype)
        self._at("forward")
        loss = F.mse_loss(self.model(x), y)
        self.model.zero_grad(set_to_none=False)
        self._at("backward")
        loss.backward()
        self._fault("backward_done")
        self.batch, self.loss = batch, loss.detach()
        return self.loss

    def sync_step(self):
        """Gradients averaged over the ranks, AdamW, the schedule; the step is recorded."""
        self._at("all_reduce")
        grads = [p.grad for p in self.model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat /= self.world_size
        vector_to_parameters(flat, grads)
        self._at("optimizer")
        self.lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self._fault("end")
        self._record()

    def skip_step(self):
        """The step's update is skipped (its gradients thrown away): the data and the schedule move on."""
        self.model.zero_grad(set_to_none=False)
        self.lr = self.optimizer.param_groups[0]["lr"]
        self.skipped.append(self.step)
        self.scheduler.step()
        self._record()

    def _record(self):
        self.losses[self.step] = float(self.loss)
        self.seen[self.step] = self.batch.tolist()
        self.lrs[self.step] = float(self.lr)
        self.draws[self.step] = self.draw
        self.step += 1

    def flat_parameters(self):
        return parameters_to_vector(self.model.parameters()).detach().clone()

    def report(self):
        """What a rank returns: per step its loss, samples, learning rate and random states (`draws`), the
        final parameters, this rank's optimizer piece, the learning rate, the steps skipped."""
        return {"losses": dict(self.losses), "seen": dict(self.seen), "lrs": dict(self.lrs),
                "draws": dict(self.draws), "params": self.flat_parameters(),
                "exp_avg": self.optimizer.exp_avg.clone(), "exp_avg_sq": self.optimizer.exp_avg_sq.clone(),
                "opt_bounds": list(self.optimizer.bounds), "lr": self.optimizer.param_groups[0]["lr"],
                "step": self.step, "skipped": list(self.skipped), "fired": list(self.fired)}

    # -- faults and heartbeats ----------------------------------------------------------------------
    def _at(self, where):
        if self.beat_hook is not None:
            self.beat_hook(self.step, where)
        self._fault(where)

    def _fault(self, where):
        step = self.step
        for fault in self.faults:
            if fault["where"] == where and fault["step"] == step and not fault.get("done"):
                fault["done"] = True
                self.fired.append([fault["kind"], step, where])
                INJECT[fault["kind"]](self, fault)


def random_fingerprints(generator):
    """Where each of a rank's three random streams stands (a CRC of its state): two runs that draw the
    same numbers from here on have the same three fingerprints."""
    return {"torch": zlib.crc32(torch.get_rng_state().numpy().tobytes()),
            "generator": zlib.crc32(generator.get_state().numpy().tobytes()),
            "python": zlib.crc32(repr(random.getstate()).encode())}


def rank_mesh(world_size, group=None):
    """A 1-D DeviceMesh over the ranks (of `group`), on the CPU: the layout of the sharded moments."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if group is None:
        return init_device_mesh("cpu", (world_size,))
    return DeviceMesh.from_group(group, "cpu")


# --------------------------------------------------------------------------- injected faults

def _kill(trainer, fault):
    """The rank dies at once, as a node that loses power: no exception, no cleanup, no message.

    Under the grader each rank is the first process of its own pid namespace, and the kernel drops a
    SIGKILL such a process sends itself (pid_namespaces(7): a namespace's init receives only signals it has a
    handler for); so the rank then leaves at once with SIGKILL's exit status, without cleanup either."""
    os.kill(os.getpid(), signal.SIGKILL)
    os._exit(128 + signal.SIGKILL)


def _hang(trainer, fault):
    """The rank stops (a stuck data loader, a deadlocked thread) until `release` appears in the
    heartbeat folder (its peers create it once they have named it) or `seconds` pass; then its step
    ends (Fault), so that it never joins the collective its peers gave up on."""
    folder, seconds = fault.get("folder"), fault.get("seconds", 10.0)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if folder and os.path.exists(os.path.join(folder, "release")):
            break
        if fault.get("spinning") and trainer.beat_hook is not None:
            trainer.beat_hook(trainer.step, fault["where"])  # alive and beating, but going nowhere
        time.sleep(0.01)
    raise Fault(f"rank {trainer.rank} was stuck at step {trainer.step}, {fault['where']}")


def _slow(trainer, fault):
    """The rank is slow this step (a throttled GPU, a noisy neighbour): it sleeps `seconds`."""
    time.sleep(fault["seconds"])


def _flip(trainer, fault):
    """A silent error: one bit of one parameter flips on this rank (what a faulty GPU's memory does)."""
    flat = parameters_to_vector(trainer.model.parameters()).detach().clone()
    bits = flat.view(torch.int64)
    bits[fault.get("index", 0)] ^= 1 << fault.get("bit", 52)
    vector_to_parameters(flat, trainer.model.parameters())


def _nan(trainer, fault):
    """This rank's local gradient holds a NaN (an overflow in a fused kernel, a bad sample)."""
    param = next(trainer.model.parameters())
    param.grad.view(-1)[fault.get("index", 0)] = float("nan")


INJECT = {"kill": _kill, "hang": _hang, "slow": _slow, "flip": _flip, "nan": _nan}


# --------------------------------------------------------------------------- the reference

def simulate(job, world_size, steps=None, sampler=ShardSampler, skip=()):
    """The job for `world_size` ranks, in one process: {"losses": [step][rank], "seen": [step][rank],
    "params": final flat parameters, "exp_avg", "exp_avg_sq": whole moments, "lr"}.

    skip: steps whose update every rank skips (their data and schedule still advance). Without dropout and
    noise (job["dropout"] = job["noise"] = 0) the job on N ranks is the job on 1 rank with the same global
    batches: the reference of a run that changes its world size."""
    steps = job["steps"] if steps is None else steps
    model = build_model(job).train()
    optimizer = ShardedAdamW(model.parameters(), lr=job["lr"], weight_decay=job["weight_decay"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, warmup=job["warmup"],
                                                                     steps=job["steps"]))
    x, y = job_data(job)
    streams = []
    for rank in range(world_size):
        seeds = rank_seeds(job, rank)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seeds["torch"])
            torch_state = torch.get_rng_state()
        streams.append({"torch": torch_state, "python": random.Random(seeds["python"]),
                        "generator": torch.Generator().manual_seed(seeds["generator"]),
                        "sampler": sampler(job["samples"], job["global_batch"], job["seed"], rank,
                                           world_size)})
    losses, seen = [], []
    for step in range(steps):
        step_losses, step_seen, grads = [], [], []
        for stream in streams:
            batch = torch.as_tensor(stream["sampler"].next_batch(), dtype=torch.long)
            xb, yb = x[batch], y[batch]
            if job["noise"]:
                strength = job["noise"] * (1.0 + stream["python"].random())
                xb = xb + strength * torch.randn(xb.shape, generator=stream["generator"], dtype=xb.dtype)
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(stream["torch"])
                loss = F.mse_loss(model(xb), yb)
                stream["torch"] = torch.get_rng_state()
            model.zero_grad(set_to_none=False)
            loss.backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
            step_losses.append(float(loss.detach()))
            step_seen.append(batch.tolist())
        losses.append(step_losses)
        seen.append(step_seen)
        if step in skip:
            scheduler.step()
            continue
        total = grads[0].clone()
        for g in grads[1:]:
            total += g
        vector_to_parameters(total / world_size, [p.grad for p in model.parameters()])
        optimizer.step()
        scheduler.step()
    params = parameters_to_vector(model.parameters()).detach().clone()
    return {"losses": losses, "seen": seen, "params": params,
            "exp_avg": optimizer.exp_avg.clone(), "exp_avg_sq": optimizer.exp_avg_sq.clone(),
            "lr": optimizer.param_groups[0]["lr"]}
