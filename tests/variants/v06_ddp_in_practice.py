"""Planted bugs for 06_ddp_in_practice: each must lose the listed cells with a message saying why.

Every variant is the correct train_ddp with one realistic mistake (BASE below, edited by `_bug`).
"""

BASE = '''
def train_ddp(make_model, dataset, epochs, global_batch, lr, seed, checkpoint_dir):
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
'''


def _bug(old, new):
    assert old in BASE, old
    return BASE.replace(old, new)


VARIANTS = {
    "sampler_without_set_epoch": {
        "cells": {"train_ddp": _bug("        sampler.set_epoch(epoch)\n", "")},
        "loses": {"test_train_ddp_matches_single_process": "call sampler.set_epoch(epoch)",
                  "test_train_ddp_edge_cases": "call sampler.set_epoch(epoch)"},
    },
    "all_ranks_on_the_same_data": {  # no DistributedSampler: every rank shuffles the whole data set
        "cells": {"train_ddp": _bug(
            "loader = DataLoader(dataset, batch_size=global_batch // world, sampler=sampler)",
            "loader = DataLoader(dataset, batch_size=global_batch // world, shuffle=True)")},
        "loses": {"test_train_ddp_matches_single_process": "every rank trained on the same samples",
                  "test_train_ddp_edge_cases": "every rank trained on the same samples"},
    },
    "sampler_seeded_by_rank": {
        "cells": {"train_ddp": _bug("DistributedSampler(dataset, shuffle=True, seed=seed)",
                                    "DistributedSampler(dataset, shuffle=True, seed=seed + rank)")},
        "loses": {"test_train_ddp_matches_single_process": "by no rank",
                  "test_train_ddp_edge_cases": "must shuffle with the same seed"},
    },
    "loss_not_averaged_across_ranks": {
        "cells": {"train_ddp": _bug("        dist.all_reduce(totals)\n", "")},
        "loses": {"test_train_ddp_matches_single_process": "the ranks disagree",
                  "test_train_ddp_edge_cases": "the ranks disagree"},
        "keeps": ["test_train_ddp_checkpoint"],
    },
    "checkpoint_written_by_every_rank": {
        "cells": {"train_ddp": _bug(
            "        if rank == 0:\n            torch.save(",
            "        if True:\n            torch.save(")},
        "loses": {"test_train_ddp_checkpoint": "rank 1 wrote the checkpoint"},
        "keeps": ["test_train_ddp_matches_single_process", "test_train_ddp_edge_cases"],
    },
    "resume_without_optimizer_state": {
        "cells": {"train_ddp": _bug('        optimizer.load_state_dict(checkpoint["optimizer"])\n', "")},
        "loses": {"test_train_ddp_checkpoint": "restore the model and the optimizer"},
        "keeps": ["test_train_ddp_matches_single_process", "test_train_ddp_edge_cases"],
    },
}
