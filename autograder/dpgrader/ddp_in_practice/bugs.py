"""Planted bugs for 06_ddp_in_practice: each is the solution's train_ddp with one realistic mistake."""

from dpgrader.planted import Bug

BUGS = [
    Bug("train_ddp", "sampler_without_set_epoch",
        patch=[("        sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank\n", "")],
        loses={"test_train_ddp_matches_single_process": "call sampler.set_epoch(epoch)",
               "test_train_ddp_edge_cases": "call sampler.set_epoch(epoch)"}),
    Bug("train_ddp", "all_ranks_on_the_same_data",  # no DistributedSampler: every rank shuffles all the data
        patch=[("loader = DataLoader(dataset, batch_size=global_batch // world, sampler=sampler)",
                "loader = DataLoader(dataset, batch_size=global_batch // world, shuffle=True)")],
        loses={"test_train_ddp_matches_single_process": "every rank trained on the same samples",
               "test_train_ddp_edge_cases": "every rank trained on the same samples"}),
    Bug("train_ddp", "sampler_seeded_by_rank",
        patch=[("DistributedSampler(dataset, shuffle=True, seed=seed)",
                "DistributedSampler(dataset, shuffle=True, seed=seed + rank)")],
        loses={"test_train_ddp_matches_single_process": "by no rank",
               "test_train_ddp_edge_cases": "must shuffle with the same seed"}),
    Bug("train_ddp", "loss_not_averaged_across_ranks",
        patch=[("        dist.all_reduce(totals)\n", "")],
        loses={"test_train_ddp_matches_single_process": "the ranks disagree",
               "test_train_ddp_edge_cases": "the ranks disagree"},
        keeps=["test_train_ddp_checkpoint"]),
    Bug("train_ddp", "checkpoint_written_by_every_rank",
        patch=[("        if rank == 0:  # one writer\n", "        if True:\n")],
        loses={"test_train_ddp_checkpoint": "rank 1 wrote the checkpoint"},
        keeps=["test_train_ddp_matches_single_process", "test_train_ddp_edge_cases"]),
    Bug("train_ddp", "resume_without_optimizer_state",
        patch=[('        optimizer.load_state_dict(checkpoint["optimizer"])\n', "")],
        loses={"test_train_ddp_checkpoint": "restore the model and the optimizer"},
        keeps=["test_train_ddp_matches_single_process", "test_train_ddp_edge_cases"]),
]
