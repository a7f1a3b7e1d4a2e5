"""Checks of a data-parallel training run against one process trained on the same global batches.

Used by the test cells and hidden checks of notebooks 05 (expect_single_process_equivalence: first
gradients averaged, ranks identical, parameters equal to one process after several steps) and 06
(train_ddp: DistributedSampler's order, epoch losses, who writes the checkpoint).

The references come from dpcourse.reference.training (one training loop); these functions compare
a run with them and say what went wrong in the words a learner can act on ("call
sampler.set_epoch(epoch)", "rank 1 wrote the checkpoint"), not just "not equal".
"""

import os

import torch

from dpcourse.checks.core import number, shorten
from dpcourse.checks.params import expect_averaged_gradients, expect_identical_across_ranks, expect_same_state
from dpcourse.reference.gradients import single_process_gradients, state_of
from dpcourse.reference.splits import ceil_div
from dpcourse.reference.training import sampler_orders, sgd, train_single_process
from dpcourse.toys.data import global_batch, my_share

CHECKPOINT = "checkpoint.pt"


def expect_run_results(results):
    """Each rank returned the dict the exercise asks for: model, seen, losses."""
    for rank, result in enumerate(results):
        if not isinstance(result, dict) or not {"model", "seen", "losses"} <= set(result):
            got = sorted(result) if isinstance(result, dict) else type(result).__name__
            raise AssertionError(f"rank {rank}: train_ddp should return a dict with keys 'model', "
                                 f"'seen' and 'losses', got {got}")


def expect_losses(results, expected, what="the epoch losses", rel=1e-9):
    """Every rank reports the same global mean loss per epoch as the reference."""
    for rank, result in enumerate(results):
        got = result.get("losses") if isinstance(result, dict) else None
        if not isinstance(got, dict) or sorted(got) != sorted(expected):
            raise AssertionError(f"rank {rank}: 'losses' should map each epoch trained "
                                 f"{sorted(expected)} to a float, got {got!r}")
        for epoch, want in expected.items():
            have = got[epoch]
            have = have.item() if isinstance(have, torch.Tensor) else have
            if not isinstance(have, float) or abs(have - want) > rel * max(1.0, abs(want)):
                others = [r.get("losses", {}).get(epoch) for r in results]
                hint = ""
                if len(results) > 1 and len({repr(o) for o in others}) > 1:
                    hint = (" -- the ranks disagree: each rank reported the loss of its own "
                            "samples; all-reduce the sum of losses and the sample count, then "
                            "divide")
                raise AssertionError(f"rank {rank}: {what}, epoch {epoch}: got {number(have)}, expected "
                                     f"the mean over every rank's samples {number(want)}{hint}")


def expect_sampler_behaviour(results, n, world_size, seed, epochs):
    """Check the `seen` record of each rank against DistributedSampler, with a diagnosis.

    results[r]["seen"] maps each epoch trained to the list of sample indices rank r
    trained on, in order. `epochs` lists the epochs this run should have trained.
    """
    epochs = list(epochs)
    seen = []
    for rank, result in enumerate(results):
        record = result.get("seen") if isinstance(result, dict) else None
        if not isinstance(record, dict) or sorted(record) != epochs:
            keys = sorted(record) if isinstance(record, dict) else record
            raise AssertionError(f"rank {rank}: 'seen' should map each epoch trained {epochs} to "
                                 f"the list of sample indices trained on, got {keys!r}")
        seen.append({e: [int(i) for i in record[e]] for e in epochs})
    per_rank = ceil_div(n, world_size)
    for epoch in epochs:
        expected = sampler_orders(n, world_size, seed, epoch)
        if world_size > 1 and all(seen[r][epoch] == seen[0][epoch] for r in range(world_size)):
            raise AssertionError(f"epoch {epoch}: every rank trained on the same samples "
                                 f"{_indices(seen[0][epoch])}: each rank must take its own shard "
                                 "(a DistributedSampler in the DataLoader)")
        counts = torch.bincount(torch.tensor([i for r in range(world_size) for i in seen[r][epoch]],
                                             dtype=torch.long), minlength=n)
        never = torch.nonzero(counts[:n] == 0).flatten().tolist()
        if never or sum(len(seen[r][epoch]) for r in range(world_size)) != per_rank * world_size:
            twice = torch.nonzero(counts > 1).flatten().tolist()
            raise AssertionError(f"epoch {epoch}: samples {_indices(never)} were trained on by no rank "
                                 f"and {_indices(twice)} by several (per-rank counts "
                                 f"{[len(seen[r][epoch]) for r in range(world_size)]}, expected "
                                 f"{per_rank} each): every rank's DistributedSampler must shuffle "
                                 f"with the same seed")
        for rank in range(world_size):
            if epoch > 0 and epoch - 1 in seen[rank] and seen[rank][epoch] == seen[rank][epoch - 1]:
                raise AssertionError(f"rank {rank} trained on the same samples in the same order "
                                     f"in epochs {epoch - 1} and {epoch}: call "
                                     f"sampler.set_epoch(epoch) at the start of every epoch")
            if seen[rank][epoch] != expected[rank]:
                raise AssertionError(f"rank {rank}, epoch {epoch}: trained on "
                                     f"{_indices(seen[rank][epoch])}, expected DistributedSampler's "
                                     f"order {_indices(expected[rank])} (shuffle=True, seed=seed, "
                                     f"set_epoch(epoch))")


def _indices(indices):
    return f"[{shorten(indices, more='...', fmt=str)}]"


def with_save_log(fn, *args, **kwargs):
    """Run fn(*args, **kwargs) in this rank, logging the target of every torch.save call.

    Returns (fn's result, [str(target), ...]). How a test sees which ranks write
    a checkpoint: files written by several ranks look the same afterwards.
    """
    saves, original = [], torch.save

    def logging_save(obj, f, *more, **options):
        saves.append(os.fspath(f) if isinstance(f, (str, os.PathLike)) else repr(f))
        return original(obj, f, *more, **options)

    torch.save = logging_save
    try:
        return fn(*args, **kwargs), saves
    finally:
        torch.save = original


def expect_rank_zero_writes(save_logs, folder):
    """Only rank 0 may write the checkpoint; it must write it at least once."""
    for rank, saves in enumerate(save_logs):
        if rank > 0 and saves:
            raise AssertionError(f"rank {rank} wrote the checkpoint (torch.save to {saves[0]}): only "
                                 "rank 0 may write it -- ranks writing the same file at once can "
                                 "leave it corrupt, and it is N times the I/O")
    if not save_logs[0] or not os.path.exists(os.path.join(folder, CHECKPOINT)):
        raise AssertionError(f"rank 0 did not write {CHECKPOINT} in checkpoint_dir with torch.save "
                             f"(it called torch.save on {save_logs[0]})")


def read_checkpoint(folder):
    """The checkpoint a run left in `folder`, checked for the keys the exercise asks for."""
    path = os.path.join(folder, CHECKPOINT)
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(checkpoint, dict) or not {"epoch", "model", "optimizer"} <= set(checkpoint):
        keys = sorted(checkpoint) if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise AssertionError(f"{CHECKPOINT} should be a dict with keys 'epoch', 'model', "
                             f"'optimizer', got {keys}")
    return checkpoint


def expect_single_process_equivalence(results, make_model, X, Y, steps, per_rank, what,
                                      make_optimizer=sgd, atol=1e-9):
    """The check of every DDP exercise, on the results of a launch.

    results[r] = (rank r's gradients right after the first step's synchronisation,
    rank r's state after `steps` steps), each rank having trained on `my_share` of
    global batches of per_rank * N rows. Checks, in order: first-step gradients are
    the global average; ranks are identical; parameters equal one process trained
    with the same optimizer on the same global batches.
    """
    world_size = len(results)
    global_size = per_rank * world_size
    model = make_model()
    average = single_process_gradients(model, *global_batch(X, Y, 0, global_size))
    for rank, (grads, _) in enumerate(results):
        local = single_process_gradients(model, *my_share(X, Y, 0, per_rank, rank, world_size, "cpu"))
        expect_averaged_gradients(grads, average, local, world_size,
                                  f"{what}, gradients after the first step", rank=rank, atol=atol)
    expect_identical_across_ranks([state for _, state in results])
    reference = state_of(train_single_process(make_model(), X, Y, steps, global_size, make_optimizer))
    for rank, (_, state) in enumerate(results):
        expect_same_state(state, reference, f"{what}, after {steps} steps compared with one process "
                          f"on the same global batches", rank=rank, atol=atol)
