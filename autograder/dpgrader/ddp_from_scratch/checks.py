"""Hidden checks of 05_ddp_from_scratch. Each raises a short AssertionError saying what is wrong.

The yardstick of every DDP check is independent of the learner's code: one process
training on the same global batches (dpcourse.toys.models), torch's own
DistributedSampler, and bucket counts computed from the rule the notebook states.
Communication is observed with dpcourse.comm.recorder.CommRecorder, inside the ranks.
"""

from collections import Counter

from torch.utils.data import DistributedSampler

from dpcourse import launch
from dpcourse.checks.core import shorten
from dpcourse.checks.params import expect_averaged_gradients, expect_same_state
from dpcourse.reference.gradients import single_process_gradients, state_of
from dpcourse.reference.splits import ceil_div
from dpcourse.runtime.timeouts import TIMEOUTS
from dpcourse.topics.ddp.checks import expect_single_process_equivalence
from dpcourse.topics.ddp.samplers import expect_len_as_dealt, run_sampler_cases
from dpcourse.toys.data import my_share, smooth_regression_data
from dpcourse.toys.models import MODELS
from dpgrader.ddp_from_scratch import ranks
from dpgrader.ddp_from_scratch.tuned import bucket_assignment

# What each exercise's expected values come from (autograder/exercises.json lists them).
REFERENCES = {
    "broadcast_model": "the model rank 0 builds from the same seed",
    "shard_sampler": "torch.utils.data.DistributedSampler with the same arguments",
    "average_gradients": "one process trained on the same global batches "
                         "(dpcourse.reference.training.train_single_process)",
    "bucketed_ddp": "one process trained on the same global batches; the bucket rule the notebook states "
                    "(dpgrader.ddp_from_scratch.tuned.bucket_assignment)",
    "accumulating_ddp": "one process trained on the same global batches; one all-reduce per parameter "
                        "outside no_sync(), none inside",
    "distributed_optimizer": "one process trained with the same optimizer on the same global batches; the "
                             "fusion rule the notebook states",
}

GROUP_TIMEOUT = TIMEOUTS["test_group"]


def _launch(fn, world_size, *args):
    return launch(fn, world_size, *args, group_timeout=GROUP_TIMEOUT)


def _runs(fn, world_size, *args):
    """Launch a ranks.*_cases runner; each rank's RankRun, rebuilt from the plain values it returned."""
    return [ranks.RankRun.from_plain(plain) for plain in _launch(fn, world_size, *args)]


def _short(values):
    return f"[{shorten(values)}]"


# --------------------------------------------------------------------------- 1. broadcast_model

def check_broadcast_model(broadcast_model):
    for world_size, names in [(3, ["mlp_with_batchnorm", "frozen_first_layer", "tied_layers", "deep_mlp"]),
                              (1, ["mlp_with_batchnorm"])]:
        per_rank = _launch(ranks.broadcast_cases, world_size, broadcast_model, names, 20)
        for name in names:
            expected = MODELS[name](seed=20)
            ranks.perturb_buffers(expected, 0)
            expected = state_of(expected)
            for rank, results in enumerate(per_rank):
                state, same_objects = results[name]
                expect_same_state(state, expected, f"after broadcast_model({name}) on {world_size} ranks, "
                                  f"every parameter and buffer should hold rank 0's values", rank=rank,
                                  atol=0.0)
                if not same_objects:
                    raise AssertionError(f"rank {rank}: broadcast_model({name}) replaced parameter objects: "
                                         f"copy into the existing tensors (an optimizer built before the "
                                         f"broadcast still points to them)")


# --------------------------------------------------------------------------- 2. ShardSampler

SAMPLER_CASES = [  # n, world size, shuffle, seed, drop_last
    (10, 4, True, 0, False), (10, 4, True, 0, True), (10, 4, False, 0, False), (10, 4, False, 0, True),
    (3, 4, True, 1, False), (7, 1, True, 2, False), (12, 3, True, 5, False), (13, 5, True, 7, True),
    (10_001, 4, True, 3, False), (10_001, 4, True, 3, True),
    (2, 5, False, 0, False), (2, 5, True, 8, False), (1, 3, True, 9, False),  # padding longer than the data
]


def explain_sampler_shards(shards, n, drop_last, what):
    """The policy's properties, each with its own message (used before the exact comparison)."""
    world_size = len(shards)
    length = n // world_size if drop_last else ceil_div(n, world_size)
    for rank, shard in enumerate(shards):
        if len(shard) != length:
            raise AssertionError(
                f"{what}: rank {rank} gets {len(shard)} indices, expected {length} "
                f"({'drop_last: floor' if drop_last else 'padded: ceil'}({n}/{world_size})): every rank "
                f"must get the same number of samples, or one rank runs an extra step and its "
                f"all-reduce waits forever")
    if world_size > 1 and n >= world_size and all(s == shards[0] for s in shards):
        raise AssertionError(f"{what}: every rank gets the same indices {_short(shards[0])}: all ranks "
                             f"train on the same data (use the rank to pick positions rank, rank+N, ...)")
    counts = Counter(i for shard in shards for i in shard)
    outside = sorted(i for i in counts if not 0 <= i < n)
    if outside:
        raise AssertionError(f"{what}: indices {_short(outside)} are not in range({n})")
    if drop_last:
        twice = sorted(i for i, c in counts.items() if c > 1)
        if twice:
            raise AssertionError(f"{what}: samples {_short(twice)} are used more than once in an epoch "
                                 f"(drop_last drops the tail, it never repeats)")
    else:
        never = sorted(set(range(n)) - set(counts))
        if never:
            raise AssertionError(f"{what}: samples {_short(never)} are never used in this epoch: every "
                                 f"sample must be seen at least once across ranks")
        extra = sum(counts.values()) - n  # padding: every sample is used, so these are repeats
        if max(counts.values()) > 1 + ceil_div(extra, max(n, 1)):
            raise AssertionError(f"{what}: some samples are used too often, e.g. sample "
                                 f"{counts.most_common(1)[0][0]} {counts.most_common(1)[0][1]} times")


def check_shard_sampler(ShardSampler):
    """Every case and epoch runs in one launch (`run_sampler_cases`); verdicts are reached here."""
    cases = [dict(n=n, world_size=world_size, epoch=epoch, shuffle=shuffle, seed=seed, drop_last=drop_last)
             for n, world_size, shuffle, seed, drop_last in SAMPLER_CASES for epoch in range(3)]
    runs = iter(run_sampler_cases(ShardSampler, cases))
    for n, world_size, shuffle, seed, drop_last in SAMPLER_CASES:
        per_epoch = []
        for epoch in range(3):
            what = (f"ShardSampler({n}, num_replicas={world_size}, shuffle={shuffle}, seed={seed}, "
                    f"drop_last={drop_last}), epoch {epoch}")
            run = next(runs)
            expect_len_as_dealt(run, n, world_size)
            shards = run["shards"]
            explain_sampler_shards(shards, n, drop_last, what)
            per_epoch.append(shards)
            for rank, shard in enumerate(shards):
                reference = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=shuffle,
                                               seed=seed, drop_last=drop_last)
                reference.set_epoch(epoch)
                expected = list(reference)
                if shuffle and epoch and n > 3 and shard == per_epoch[0][rank]:
                    raise AssertionError(f"{what}: rank {rank} gets the same order as in epoch 0: "
                                         f"set_epoch must change the shuffle (seed it with seed + epoch)")
                if shard != expected:
                    raise AssertionError(f"{what}: rank {rank} gets {_short(shard)}, DistributedSampler "
                                         f"gives {_short(expected)} (shuffle with torch.randperm and a "
                                         f"generator seeded with seed + epoch, pad with the first "
                                         f"indices, then take positions rank, rank + N, ...)")


# --------------------------------------------------------------------------- training on ranks

def _make(name, seed):
    return lambda: MODELS[name](seed=seed)


# --------------------------------------------------------------------------- 3. average_gradients

def expect_finished(runs, message):
    """Every rank trained every case; `message` says it otherwise (fields: rank, failed, error)."""
    for rank, run in enumerate(runs):
        if run.error is not None:
            raise AssertionError(message.format(rank=rank, failed=run.failed, error=run.error))


def expect_like_one_process(runs, index, make_model, seed, steps, per_rank, what, **options):
    """Case `index` of every rank's run against one process trained on the same global batches."""
    X, Y = smooth_regression_data(steps * per_rank * len(runs), seed=seed)
    expect_single_process_equivalence([run.cases[index].pair() for run in runs], make_model, X, Y, steps,
                                      per_rank, what, **options)


def check_average_gradients(average_gradients):
    cases = [("deep_mlp", 3), ("frozen_first_layer", 4), ("tied_layers", 5), ("unused_head", 6)]
    for world_size in (3, 1):
        runs = _runs(ranks.average_gradients_cases, world_size, average_gradients, cases, 3, 2)
        expect_finished(runs, "rank {rank}: average_gradients raised on {failed}: {error}")
        for i, (name, seed) in enumerate(cases):
            expect_like_one_process(runs, i, _make(name, seed), seed, 3, 2,
                                    f"average_gradients on {name}, {world_size} ranks")


# --------------------------------------------------------------------------- 4. BucketedDDP

def expected_buckets(model, bucket_cap):
    """Byte sizes of the buckets the stated rule makes (reverse order, close at >= bucket_cap)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [sum(p.numel() * p.element_size() for p in bucket)
            for bucket in bucket_assignment(trainable, bucket_cap)]


def expect_bucket_traffic(comms, model, cap, what, rank=0):
    """comms[step] = [(op, nbytes), ...] of one rank: one all-reduce per bucket, every gradient once."""
    sizes = expected_buckets(model, cap)
    total = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    for step, ops in enumerate(comms):
        others = sorted({op for op, _ in ops if op != "all_reduce"})
        if others:
            raise AssertionError(f"rank {rank}: {what} called {others} in step {step}: use dist.all_reduce")
        _expect_all_reduces(ops, sizes, total, what, rank, step,
                            f"buckets of {sizes} bytes: parameters in reverse order, a bucket closes "
                            f"once it holds >= {cap} bytes")


def reset_hint(step):
    """After step 0, a wrong count of all-reduces points at state carried over from the last step."""
    if step == 0:
        return ""
    return ("; step 0 was right, so look at what carries over between steps: is each bucket's ready "
            "state (set or counter) reset in finish_gradient_sync?")


def _expect_all_reduces(ops, sizes, total, what, rank, step, rule):
    """One step's all-reduces: as many as `sizes` says (the `rule` explains why), every byte once."""
    if len(ops) != len(sizes):
        raise AssertionError(f"rank {rank}: {what} issued {len(ops)} all-reduces in step {step}, "
                             f"expected {len(sizes)} ({rule}){reset_hint(step)}")
    sent = sum(n for _, n in ops)
    if sent != total:
        raise AssertionError(f"rank {rank}: {what} all-reduced {sent} bytes in step {step}, but the "
                             f"gradients hold {total} bytes: a parameter is left out or sent twice")


def expect_overlap(starts, backward_end, what, rank=0):
    if not starts:
        raise AssertionError(f"rank {rank}: {what} issued no all-reduce")
    if starts[0] >= backward_end:
        raise AssertionError(
            f"rank {rank}: {what}: the first all-reduce started {1e3 * (starts[0] - backward_end):.2f} ms "
            f"after backward ended: nothing overlaps with backward. Launch each bucket's all-reduce from "
            f"the gradient hooks, as soon as the bucket is full")


def check_bucketed_ddp(BucketedDDP):
    """Deterministic checks first (a late peer, unused parameters), then equality, traffic, overlap."""
    delay = 0.5
    grads, backward_s = _launch(ranks.slow_peer, 2, BucketedDDP, delay)[0]
    X, Y = smooth_regression_data(8, seed=9)
    model = MODELS["deep_mlp"](seed=9)
    average = single_process_gradients(model, X, Y)
    local = single_process_gradients(model, *my_share(X, Y, 0, 4, 0, 2, "cpu"))
    expect_averaged_gradients(grads, average, local, 2, f"with rank 1 starting backward {delay} s late, "
                              f"after finish_gradient_sync returned", rank=0)
    if _backend_is_gloo() and backward_s > delay / 2:
        raise AssertionError(
            f"rank 0: with rank 1 starting backward {delay} s late, rank 0's backward took {backward_s:.2f} "
            f"s: the hooks wait for each all-reduce, so backward stalls instead of overlapping. Launch "
            f"with async_op=True in the hooks and wait only in finish_gradient_sync")

    for rank, outcome in enumerate(_launch(ranks.unused_probe, 2, BucketedDDP)):
        if outcome is None:
            raise AssertionError(
                f"rank {rank}: BucketedDDP trained a model whose parameters unused_head.weight and "
                f"unused_head.bias get no gradient, without complaint: their bucket is never reduced. "
                f"finish_gradient_sync must raise a RuntimeError naming them")
        kind, message = outcome
        if kind != "RuntimeError" or "unused_head" not in message:
            raise AssertionError(f"rank {rank}: on a model with an unused parameter, BucketedDDP raised "
                                 f"{kind}: {message[:200]!r}; expected a RuntimeError naming "
                                 f"unused_head.weight")

    cases = [("deep_mlp", 11, 1), ("deep_mlp", 12, 600), ("deep_mlp", 13, 10 ** 9),
             ("tied_layers", 14, 700), ("frozen_first_layer", 15, 300)]
    for world_size in (3, 1):
        runs = _runs(ranks.bucketed_cases, world_size, BucketedDDP, cases, 3, 2)
        expect_finished(runs, "rank {rank}: {failed} raised {error}")
        for i, (name, seed, cap) in enumerate(cases):
            what = f"BucketedDDP({name}, bucket_cap={cap}) on {world_size} ranks"
            for rank, run in enumerate(runs):  # the count of all-reduces first: it names the cause
                expect_bucket_traffic(run.cases[i].traffic, MODELS[name](seed=seed), cap, what, rank)
            expect_like_one_process(runs, i, _make(name, seed), seed, 3, 2, what)

    for rank, (starts, backward_end) in enumerate(_launch(ranks.overlap_probe, 2, BucketedDDP, 4096)):
        expect_overlap(starts, backward_end, "BucketedDDP(deep_mlp(depth=12), bucket_cap=4096)", rank)


def _backend_is_gloo():
    from dpcourse import resolve_backend

    return resolve_backend(2) == "gloo"


# --------------------------------------------------------------------------- 5. AccumulatingDDP

def expect_accumulation_traffic(counts, model, what, rank=0):
    """counts = [(inside no_sync, number of collectives during that backward), ...]"""
    n_params = sum(1 for p in model.parameters() if p.requires_grad)
    for inside, count in counts:
        if inside and count:
            raise AssertionError(f"rank {rank}: {what}: {count} all-reduces during a backward inside "
                                 f"no_sync(): there gradients must only accumulate locally")
        if not inside and count != n_params:
            raise AssertionError(f"rank {rank}: {what}: {count} all-reduces during the backward after "
                                 f"no_sync(), expected {n_params} (one per parameter): leaving no_sync() "
                                 f"must turn synchronisation back on")


def check_accumulating_ddp(AccumulatingDDP):
    cases = [("deep_mlp", 21), ("tied_layers", 22)]
    steps, micro, K = 2, 2, 3
    for world_size in (3, 1):
        runs = _runs(ranks.accumulating_cases, world_size, AccumulatingDDP, cases, steps, micro, K)
        expect_finished(runs, "rank {rank}: AccumulatingDDP on {failed} raised {error}")
        for i, (name, seed) in enumerate(cases):
            what = f"AccumulatingDDP({name}) on {world_size} ranks, {K} micro-batches per step"
            model = MODELS[name](seed=seed)
            n_params = sum(1 for p in model.parameters() if p.requires_grad)
            for rank, run in enumerate(runs):
                trained = run.cases[i]
                after_exception, nested = trained.after_exception, trained.nested
                expect_accumulation_traffic(trained.traffic, model, what, rank)
                if after_exception != n_params:
                    raise AssertionError(
                        f"rank {rank}: after an exception inside `with model.no_sync():`, the next "
                        f"backward issued {after_exception} all-reduces, expected {n_params}: restore the "
                        f"flag in a `finally:` so it is restored whatever happens inside")
                if nested:
                    raise AssertionError(
                        f"rank {rank}: after a nested no_sync() ended, a backward still inside the outer "
                        f"no_sync() issued {nested} all-reduces: restore the previous value, not True")
            expect_like_one_process(runs, i, _make(name, seed), seed, steps, K * micro, what)


# --------------------------------------------------------------------------- 6. DistributedOptimizer

def expected_fusion(optimizer_params, threshold):
    """Byte sizes of the fusion buffers the stated rule makes (group order; close before exceeding)."""
    sizes, size = [], 0
    for p in optimizer_params:
        nbytes = p.numel() * p.element_size()
        if size and size + nbytes > threshold:
            sizes.append(size)
            size = 0
        size += nbytes
    return sizes + ([size] if size else [])


def expect_fusion_traffic(comms, params, threshold, what, rank=0):
    sizes = expected_fusion(params, threshold)
    total = sum(p.numel() * p.element_size() for p in params)
    for step, (during_backward, ops) in enumerate(comms):
        if during_backward:
            raise AssertionError(f"rank {rank}: {what} communicated during backward: reduce in step()")
        _expect_all_reduces(ops, sizes, total, what, rank, step,
                            f"fusion buffers of {sizes} bytes: gradients in param_groups order, a buffer "
                            f"is sent before the next gradient would take it over {threshold} bytes")


def check_distributed_optimizer(DistributedOptimizer):
    cases = [("deep_mlp", 31, 1), ("deep_mlp", 32, 1000), ("deep_mlp", 33, 10 ** 9),
             ("frozen_first_layer", 34, 1500)]
    for world_size in (3, 1):
        runs = _runs(ranks.optimizer_cases, world_size, DistributedOptimizer, cases, 3, 2)
        expect_finished(runs, "rank {rank}: DistributedOptimizer on {failed} raised {error}")
        for i, (name, seed, threshold) in enumerate(cases):
            what = f"DistributedOptimizer(fusion_threshold={threshold}) on {name}, {world_size} ranks"
            expect_like_one_process(runs, i, _make(name, seed), seed, 3, 2, what,
                                    make_optimizer=ranks.two_groups())
            groups = ranks.two_groups()(MODELS[name](seed=seed)).param_groups
            params = [p for group in groups for p in group["params"]]
            for rank, run in enumerate(runs):
                expect_fusion_traffic(run.cases[i].traffic, params, threshold, what, rank)


__all__ = ["check_broadcast_model", "check_shard_sampler", "check_average_gradients", "check_bucketed_ddp",
           "check_accumulating_ddp", "check_distributed_optimizer", "explain_sampler_shards",
           "expected_buckets", "expected_fusion", "expect_bucket_traffic", "expect_overlap",
           "expect_accumulation_traffic", "expect_fusion_traffic"]
