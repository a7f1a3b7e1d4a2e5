"""Hidden checks of 06_ddp_in_practice, and the grader's own DDP training function.

Every check compares the learner's `train_ddp` with single-process training on
the same global batches (dpcourse.reference.training) on cases the visible tests do
not show: one rank, three ranks with uneven shards (padding), four ranks with a
per-rank batch of 1, another model, resuming with nothing left to train.
Each raises a short AssertionError saying what is wrong.

`reference_train_ddp` is a correct solution of the exercise, kept grader-side:
tests/library/test_runtime_cluster.py runs it under torchrun (`-m dpcourse.runtime.cluster
dpgrader.ddp_in_practice.checks:reference_train_ddp`).
"""

import os
import tempfile
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from dpcourse import LaunchError, launch, rank_device
from dpcourse.reference.training import single_process_training
from dpcourse.runtime.timeouts import TIMEOUTS
from dpcourse.topics.ddp.checks import (
    expect_losses,
    expect_rank_zero_writes,
    expect_run_results,
    expect_same_state,
    expect_sampler_behaviour,
    read_checkpoint,
    with_save_log,
)
from dpcourse.toys.images import GeneratedImages
from dpcourse.toys.smallcnn import SmallCNN

# What each exercise's expected values come from (autograder/exercises.json lists them).
REFERENCES = {
    "train_ddp": "one process trained on the global batches DistributedSampler deals "
                 "(dpcourse.reference.training.single_process_training); torch.save's log for the checkpoint",
}

CNN = partial(SmallCNN, width=4, dtype=torch.float64)
PLAIN_CNN = partial(SmallCNN, width=3, norm=None, dtype=torch.float64)


def reference_train_ddp(make_model, dataset, epochs, global_batch, lr, seed, checkpoint_dir):
    """A correct train_ddp (the exercise's contract), for the tests and the torchrun check."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    torch.manual_seed(seed)
    model = make_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    path = os.path.join(checkpoint_dir, "checkpoint.pt")
    start = 0
    if os.path.exists(path):
        checkpoint = torch.load(path, map_location=device)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        start = checkpoint["epoch"] + 1
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    sampler = DistributedSampler(dataset, shuffle=True, seed=seed)
    loader = DataLoader(dataset, batch_size=global_batch // world, sampler=sampler)
    seen, losses = {}, {}
    for epoch in range(start, epochs):
        sampler.set_epoch(epoch)
        seen[epoch] = []
        totals = torch.zeros(2, dtype=torch.float64, device=device)
        for images, labels, indices in loader:
            images, labels = images.to(device), labels.to(device)
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen[epoch] += indices.tolist()
            totals[0] += loss.item() * len(labels)
            totals[1] += len(labels)
        dist.all_reduce(totals)
        losses[epoch] = (totals[0] / totals[1]).item()
        if rank == 0:
            torch.save({"epoch": epoch, "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict()}, path)
    return {"model": model.module.state_dict(), "seen": seen, "losses": losses}


def _run(train_ddp, world, n, global_batch, epochs, folder, make_model=CNN, seed=3, lr=0.05,
         what=None):
    """Launch train_ddp on `world` ranks; return (results, per-rank torch.save logs)."""
    data = GeneratedImages(n, size=8, seed=seed + 10, dtype=torch.float64)
    what = what or f"train_ddp on {world} rank(s), {n} samples, global batch {global_batch}"
    try:
        out = launch(with_save_log, world, train_ddp, make_model, data, epochs=epochs,
                     global_batch=global_batch, lr=lr, seed=seed, checkpoint_dir=folder,
                     group_timeout=TIMEOUTS["test_group"])
    except LaunchError as error:
        first = str(error).strip().splitlines()[0]
        raise AssertionError(f"{what} failed: {first}") from None
    results = [result for result, _ in out]
    expect_run_results(results)
    reference = single_process_training(make_model, data, epochs=epochs, global_batch=global_batch,
                                        lr=lr, seed=seed, world_size=world)
    return results, [saves for _, saves in out], reference


CASES = [  # world, samples, global batch, epochs, model
    (1, 24, 8, 2, CNN),
    (3, 20, 9, 2, CNN),  # 20 = 3 x 7 - 1: one padded sample; per-rank batches 3, 3, 1
    (4, 14, 8, 1, PLAIN_CNN),  # padding of 2, per-rank batch 2, a model without normalisation
]


def check_train_ddp(train_ddp):
    for world, n, batch, epochs, model in CASES:
        with tempfile.TemporaryDirectory() as folder:
            results, _, reference = _run(train_ddp, world, n, batch, epochs, folder, model)
        expect_sampler_behaviour(results, n, world, 3, range(epochs))
        for rank, result in enumerate(results):
            expect_same_state(result["model"], reference["model"],
                              f"{n} samples on {world} rank(s): the parameters after {epochs} epochs",
                              rank=rank)
        expect_losses(results, reference["losses"],
                      what=f"{n} samples on {world} rank(s): the epoch loss")


def check_train_ddp_checkpoint(train_ddp):
    for world, n, batch in [(3, 20, 9)]:
        with tempfile.TemporaryDirectory() as folder:
            results, saves, reference = _run(train_ddp, world, n, batch, 2, folder)
            expect_rank_zero_writes(saves, folder)
            checkpoint = read_checkpoint(folder)
            if checkpoint["epoch"] != 1:
                raise AssertionError(f"{world} rank(s): after epochs 0 and 1 the checkpoint's epoch "
                                     f"is {checkpoint['epoch']!r}, expected 1 (the last epoch done)")
            expect_same_state(checkpoint["model"], reference["model"],
                              f"{world} rank(s): the checkpoint's model after 2 epochs")
            what = f"resuming on {world} rank(s) from the checkpoint of epoch 1"
            resumed, saves, reference = _run(train_ddp, world, n, batch, 4, folder, what=what)
            expect_rank_zero_writes(saves, folder)
            for rank, result in enumerate(resumed):
                if sorted(result["seen"]) != [2, 3]:
                    raise AssertionError(f"rank {rank}: {what} trained epochs {sorted(result['seen'])}, "
                                         "expected [2, 3]: every rank loads the checkpoint and "
                                         "starts at its epoch + 1")
                expect_same_state(result["model"], reference["model"],
                                  f"{what}: the parameters after epoch 3", rank=rank,
                                  hint="restore the model and the optimizer (its momentum) on "
                                       "every rank")
            what = f"a run on {world} rank(s) whose checkpoint already covers every epoch"
            again, saves, reference = _run(train_ddp, world, n, batch, 4, folder, what=what)
            for rank, result in enumerate(again):
                if result["seen"] or result["losses"]:
                    raise AssertionError(f"rank {rank}: {what} trained epochs "
                                         f"{sorted(result['seen'])}, expected none")
                expect_same_state(result["model"], reference["model"], f"{what}: the parameters",
                                  rank=rank)
