"""What the hidden checks of 05_ddp_from_scratch run inside each rank, and the records ranks return.

A rank trains the learner's code on every case of a check and reports a `RankRun`: one `Trained`
per case (gradients after the first synchronisation, the final state, the communication the check
counts), or the case that raised and the error. A graded rank may only return plain values, so it
returns `run.plain()` (dicts of tensors, numbers and lists) and the check rebuilds the records with
`RankRun.from_plain`; the checks (dpgrader.ddp_from_scratch.checks) read the fields by name and compare
them with references computed on their side, never in the ranks.
"""

import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from dpcourse.backend import rank_device
from dpcourse.comm.recorder import CommRecorder
from dpcourse.reference.gradients import gradients_of, state_of
from dpcourse.reference.training import sgd
from dpcourse.toys.data import my_share, smooth_regression_data
from dpcourse.toys.models import MODELS, loss_fn


@dataclass
class Trained:
    """One rank's result for one training case."""

    first_gradients: dict  # {name: gradient} right after the first step's synchronisation
    state: dict  # every parameter and buffer after the last step
    traffic: list = field(default_factory=list)  # per step (or backward): what the check counts

    def pair(self):
        """(first gradients, state): what expect_single_process_equivalence (dpcourse.topics.ddp.checks)
        reads."""
        return self.first_gradients, self.state


@dataclass
class NoSyncTrained(Trained):
    """An AccumulatingDDP case: also the collectives of two backwards after leaving no_sync() early."""

    after_exception: int = 0  # in the backward after an exception inside `with ddp.no_sync():`
    nested: int = 0  # in a backward inside an outer no_sync(), once a nested one has ended


@dataclass
class RankRun:
    """Everything one rank did for a check: a Trained per case, in order, or where it stopped."""

    cases: list = field(default_factory=list)
    failed: str | None = None  # the case whose code raised
    error: str | None = None  # "TypeError: ..." as the learner's code raised it

    def stop(self, case, exc):
        self.failed, self.error = case, f"{type(exc).__name__}: {exc}"
        return self.plain()

    def plain(self):
        """What a rank returns: the same fields as dicts and lists (no classes of ours)."""
        return {"failed": self.failed, "error": self.error,
                "cases": [{"no_sync": isinstance(c, NoSyncTrained), **asdict(c)} for c in self.cases]}

    @classmethod
    def from_plain(cls, plain):
        cases = [(NoSyncTrained if c.pop("no_sync") else Trained)(**c) for c in plain["cases"]]
        return cls(cases, plain["failed"], plain["error"])


def train(step_fn, X, Y, steps, per_rank):
    """`steps` steps on this rank's share of each global batch; step_fn(xb, yb) returns the gradients
    to report, and the first step's are returned."""
    first = None
    for step in range(steps):
        grads = step_fn(*my_share(X, Y, step, per_rank))
        if step == 0:
            first = grads
    return first


def case_data(seed, rows_per_rank):
    return smooth_regression_data(rows_per_rank * dist.get_world_size(), seed=seed)


# --------------------------------------------------------------------------- broadcast_model

def perturb_buffers(model, rank):
    """Make every buffer rank-dependent (running statistics, counters), as local training would."""
    for buffer in model.buffers():
        buffer.add_(rank + 1)


def broadcast_cases(broadcast_model, names, seed):
    """{model name: (state after broadcast_model, whether the parameter objects are the same)}."""
    rank = dist.get_rank()
    results = {}
    for name in names:
        model = MODELS[name](seed=seed + rank, device=rank_device())
        perturb_buffers(model, rank)
        before = [id(p) for p in model.parameters()]
        broadcast_model(model)
        results[name] = (state_of(model), before == [id(p) for p in model.parameters()])
    return results


# --------------------------------------------------------------------------- average_gradients

def average_gradients_cases(average_gradients, cases, steps, per_rank):
    run = RankRun()
    for name, seed in cases:
        X, Y = case_data(seed, steps * per_rank)
        model = MODELS[name](seed=seed, device=rank_device())
        opt = sgd(model)

        def step_fn(xb, yb, model=model, opt=opt):
            opt.zero_grad()
            loss_fn(model(xb), yb).backward()
            average_gradients(model)
            grads = gradients_of(model)
            opt.step()
            return grads
        try:
            first = train(step_fn, X, Y, steps, per_rank)
        except Exception as exc:  # noqa: BLE001 - reported with the model's name
            return run.stop(name, exc)
        run.cases.append(Trained(first, state_of(model)))
    return run.plain()


# --------------------------------------------------------------------------- BucketedDDP

def bucketed_cases(BucketedDDP, cases, steps, per_rank):
    """Trained.traffic[step] = [(op, nbytes)] of the collectives of that step's backward and sync."""
    run = RankRun()
    for name, seed, cap in cases:
        X, Y = case_data(seed, steps * per_rank)
        module = MODELS[name](seed=seed, device=rank_device())
        try:
            ddp = BucketedDDP(module, bucket_cap=cap)
        except Exception as exc:  # noqa: BLE001
            return run.stop(f"BucketedDDP({name}, bucket_cap={cap})", exc)
        opt = sgd(module)
        comms = []

        def step_fn(xb, yb, ddp=ddp, module=module, opt=opt, comms=comms):
            opt.zero_grad()
            with CommRecorder() as rec:
                loss_fn(ddp(xb), yb).backward()
                ddp.finish_gradient_sync()
            comms.append([(o.op, o.nbytes) for o in rec.collectives])
            grads = gradients_of(module)
            opt.step()
            return grads
        try:
            first = train(step_fn, X, Y, steps, per_rank)
        except Exception as exc:  # noqa: BLE001
            return run.stop(f"a step of BucketedDDP({name}, bucket_cap={cap})", exc)
        run.cases.append(Trained(first, state_of(module), comms))
    return run.plain()


def overlap_probe(BucketedDDP, cap, depth=12):
    """One step of a deep MLP; returns (issue times of the all-reduces, time backward returned)."""
    X, Y = smooth_regression_data(32 * dist.get_world_size(), seed=8)
    ddp = BucketedDDP(MODELS["deep_mlp"](depth=depth, width=64, seed=8, device=rank_device()), bucket_cap=cap)
    xb, yb = my_share(X, Y, 0, 32)
    with CommRecorder() as rec:
        loss_fn(ddp(xb), yb).backward()
        backward_end = time.perf_counter()
        ddp.finish_gradient_sync()
    return [o.start for o in rec.ops if o.op == "all_reduce"], backward_end


def slow_peer(BucketedDDP, delay):
    """Rank 1 starts backward `delay` s late. Returns this rank's (gradients, seconds in backward)."""
    X, Y = smooth_regression_data(4 * dist.get_world_size(), seed=9)
    module = MODELS["deep_mlp"](seed=9, device=rank_device())
    ddp = BucketedDDP(module, bucket_cap=200)
    xb, yb = my_share(X, Y, 0, 4)
    loss = loss_fn(ddp(xb), yb)
    if dist.get_rank() == 1:
        time.sleep(delay)
    start = time.perf_counter()
    loss.backward()
    backward_s = time.perf_counter() - start
    ddp.finish_gradient_sync()
    grads = gradients_of(module)
    dist.barrier()  # a bucket left in flight completes before the ranks leave
    return grads, backward_s


def unused_probe(BucketedDDP):
    """A step of a model with an unused head: None, or (type of the exception raised, its message)."""
    X, Y = smooth_regression_data(4 * dist.get_world_size(), seed=10)
    ddp = BucketedDDP(MODELS["unused_head"](seed=10, device=rank_device()), bucket_cap=10 ** 9)
    xb, yb = my_share(X, Y, 0, 4)
    try:
        loss_fn(ddp(xb), yb).backward()
        ddp.finish_gradient_sync()
    except Exception as exc:  # noqa: BLE001
        return (type(exc).__name__, str(exc))
    return None


# --------------------------------------------------------------------------- AccumulatingDDP

class _Probe(Exception):
    pass


def accumulating_cases(AccumulatingDDP, cases, steps, micro, K):
    """NoSyncTrained.traffic = [(inside no_sync, collectives during that backward)] per micro-batch."""
    run = RankRun()
    for name, seed in cases:
        X, Y = case_data(seed, steps * K * micro)
        module = MODELS[name](seed=seed, device=rank_device())
        ddp = AccumulatingDDP(module)
        opt = sgd(module)
        counts = []

        def step_fn(xb, yb, ddp=ddp, module=module, opt=opt, counts=counts):
            opt.zero_grad()
            for k in range(K):
                rows = slice(k * micro, (k + 1) * micro)
                with CommRecorder() as rec:
                    if k < K - 1:
                        with ddp.no_sync():
                            (loss_fn(ddp(xb[rows]), yb[rows]) / K).backward()
                    else:
                        (loss_fn(ddp(xb[rows]), yb[rows]) / K).backward()
                counts.append((k < K - 1, len(rec.collectives)))
            grads = gradients_of(module)
            opt.step()
            return grads
        try:
            first = train(step_fn, X, Y, steps, K * micro)
            xb, yb = my_share(X, Y, 0, K * micro)
            try:
                with ddp.no_sync():
                    raise _Probe()
            except _Probe:
                pass
            with CommRecorder() as rec:
                loss_fn(ddp(xb), yb).backward()
            after_exception = len(rec.collectives)
            with ddp.no_sync():
                with ddp.no_sync():
                    pass
                with CommRecorder() as rec:
                    loss_fn(ddp(xb), yb).backward()
                nested = len(rec.collectives)
        except Exception as exc:  # noqa: BLE001
            return run.stop(name, exc)
        run.cases.append(NoSyncTrained(first, state_of(module), counts, after_exception, nested))
    return run.plain()


# --------------------------------------------------------------------------- DistributedOptimizer

def two_groups(lr_weights=0.1, lr_biases=0.05, momentum=0.9):
    """An optimizer factory with two parameter groups (weights, biases) and momentum."""
    def make(model):
        weights = [p for n, p in model.named_parameters() if p.requires_grad and n.endswith("weight")]
        biases = [p for n, p in model.named_parameters() if p.requires_grad and not n.endswith("weight")]
        return torch.optim.SGD([{"params": weights, "lr": lr_weights}, {"params": biases, "lr": lr_biases}],
                               lr=lr_weights, momentum=momentum)
    return make


def optimizer_cases(DistributedOptimizer, cases, steps, per_rank):
    """Trained.traffic[step] = (collectives during backward, [(op, nbytes)] of backward and step())."""
    run = RankRun()
    for name, seed, threshold in cases:
        X, Y = case_data(seed, steps * per_rank)
        module = MODELS[name](seed=seed, device=rank_device())
        try:
            opt = DistributedOptimizer(two_groups()(module), fusion_threshold=threshold)
        except Exception as exc:  # noqa: BLE001
            return run.stop(name, exc)
        comms = []

        def step_fn(xb, yb, module=module, opt=opt, comms=comms):
            opt.zero_grad()
            with CommRecorder() as rec:
                loss_fn(module(xb), yb).backward()
                backward_ops = len(rec.collectives)
                opt.step()
            comms.append((backward_ops, [(o.op, o.nbytes) for o in rec.collectives]))
            return gradients_of(module)
        try:
            first = train(step_fn, X, Y, steps, per_rank)
        except Exception as exc:  # noqa: BLE001
            return run.stop(name, exc)
        run.cases.append(Trained(first, state_of(module), comms))
    return run.plain()
