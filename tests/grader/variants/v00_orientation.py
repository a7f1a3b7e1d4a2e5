"""Planted bugs for 00_orientation: each must lose the listed cells with a message saying why."""

VARIANTS = {
    "contiguous_blocks_instead_of_strided": {
        "cells": {"my_slice": """
def my_slice(data):
    n = len(data) // dist.get_world_size()
    return data[dist.get_rank() * n:(dist.get_rank() + 1) * n]
"""},
        "loses": {"test_my_slice_basic": "rank 0: my_slice(arange(10)) has shape (2,), expected (3,)",
                  "test_my_slice_edge_cases": "my_slice of a 6x2 tensor"},
    },
    "same_slice_on_every_rank": {
        "cells": {"my_slice": """
def my_slice(data):
    return data[0::dist.get_world_size()]
"""},
        "loses": {"test_my_slice_basic": "rank 1: my_slice(arange(10)) is tensor([0, 4, 8]",
                  "test_my_slice_edge_cases": "rank 1: my_slice of a 6x2 tensor is"},
    },
    "mean_of_means": {
        "cells": {"global_mean": """
def global_mean(x):
    m = x.double().mean().reshape(1)
    dist.all_reduce(m)
    return (m / dist.get_world_size()).item()
"""},
        "loses": {"test_global_mean_unequal_shards": "global_mean of unequal shards is 4.0, expected 2"},
        "keeps": ["test_global_mean_basic"],
    },
    "float32_accumulation_in_two_all_reduces": {
        "cells": {"global_mean": """
def global_mean(x):
    total, count = x.sum(), torch.tensor(float(x.numel()))
    dist.all_reduce(total)
    dist.all_reduce(count)
    return (total / count).item()
"""},
        "loses": {"test_global_mean_unequal_shards":
                  "global_mean with shards of lengths 5, 1, 3 is 12.5555553"},
        "keeps": ["test_global_mean_basic"],
    },
    "hidden_only_bug_returns_a_tensor": {
        "cells": {"global_mean": """
def global_mean(x):
    totals = torch.tensor([x.double().sum().item(), float(x.numel())], dtype=torch.float64)
    dist.all_reduce(totals)
    return totals[0] / totals[1]
"""},
        "loses": {"test_global_mean_unequal_shards": "should return a Python float"},
    },
    "edits_the_read_only_test_cells": {
        "cells": {"test_my_slice_basic": "pass", "test_my_slice_edge_cases": "pass"},
        "loses": {"test_my_slice_basic": "NotImplementedError",
                  "test_my_slice_edge_cases": "NotImplementedError"},
    },
    "does_not_execute": {
        "cells": {"my_slice": "def my_slice(data)\n    return data"},
        "loses": {"test_my_slice_basic": "NameError"},
    },
    "spins_forever": {  # a hung learner function: the launcher's deadline stops it, the cell scores 0
        "cells": {"my_slice": """
def my_slice(data):
    while True:
        pass
"""},
        "loses": {"test_my_slice_basic": "did not finish within the 15 s deadline",
                  "test_my_slice_edge_cases": "an endless loop"},
    },
    "waits_for_a_message_nobody_sends": {
        "cells": {"global_mean": """
def global_mean(x):
    buffer = torch.zeros(1)
    dist.recv(buffer, src=(dist.get_rank() + 1) % dist.get_world_size())
    return buffer.item()
"""},
        "loses": {"test_global_mean_basic": "deadlock: ranks 0, 1, 2 and 3 of 4",
                  "test_global_mean_unequal_shards": "rank 0 in recv"},
    },
}
