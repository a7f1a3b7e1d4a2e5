"""Planted bugs for 06_ddp_in_practice: each must lose the listed cells with a message saying why.

Every variant is the correct train_ddp with one realistic mistake (BASE below, edited by `_bug`).
"""

import inspect

from dpgrader.ddp_in_practice import reference_train_ddp


def _correct_train_ddp():
    """The grader's correct train_ddp (also run under torchrun), under the exercise's name: one copy."""
    source = inspect.getsource(reference_train_ddp)
    docstring = f'    """{reference_train_ddp.__doc__}"""\n'
    assert source.count(docstring) == 1 and source.startswith("def reference_train_ddp(")
    return "\n" + source.replace(docstring, "").replace("def reference_train_ddp(", "def train_ddp(", 1)


BASE = _correct_train_ddp()


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
