"""Planted bugs for 00_orientation: each must lose the listed cells with a message saying why."""

from dpgrader.planted import Bug

SLICE = "    return data[dist.get_rank()::dist.get_world_size()]\n"
TOTALS = "    totals = torch.tensor([x.double().sum().item(), float(x.numel())], dtype=torch.float64)\n"
MEAN = ("    dist.all_reduce(totals)\n"
        "    return (totals[0] / totals[1]).item()\n")

BUGS = [
    Bug("my_slice", "contiguous_blocks_instead_of_strided",
        patch=[(SLICE, "    n = len(data) // dist.get_world_size()\n"
                       "    return data[dist.get_rank() * n:(dist.get_rank() + 1) * n]\n")],
        loses={"test_my_slice_basic": "rank 0: my_slice(arange(10)) has shape (2,), expected (3,)",
               "test_my_slice_edge_cases": "my_slice of a 6x2 tensor"}),
    Bug("my_slice", "same_slice_on_every_rank",
        patch=[(SLICE, "    return data[0::dist.get_world_size()]\n")],
        loses={"test_my_slice_basic": "rank 1: my_slice(arange(10)) is tensor([0, 4, 8]",
               "test_my_slice_edge_cases": "rank 1: my_slice of a 6x2 tensor is"}),
    Bug("global_mean", "mean_of_means",
        patch=[(TOTALS + MEAN, "    m = x.double().mean().reshape(1)\n"
                               "    dist.all_reduce(m)\n"
                               "    return (m / dist.get_world_size()).item()\n")],
        loses={"test_global_mean_unequal_shards": "global_mean of unequal shards is 4.0, expected 2"},
        keeps=["test_global_mean_basic"]),
    Bug("global_mean", "float32_accumulation",  # one all-reduce, but the sum is kept in float32
        patch=[(TOTALS, "    totals = torch.stack([x.sum(), torch.tensor(float(x.numel()))])\n")],
        loses={"test_global_mean_unequal_shards": "off by rounding only: accumulate in float64"},
        keeps=["test_global_mean_basic"]),
    Bug("global_mean", "two_all_reduces",  # a rewrite: right values, but twice the latency
        source="def global_mean(x):\n"
               "    total = x.double().sum().reshape(1)\n"
               "    count = torch.tensor([float(x.numel())], dtype=torch.float64)\n"
               "    dist.all_reduce(total)\n"
               "    dist.all_reduce(count)\n"
               "    return (total / count).item()\n",
        loses={"test_global_mean_unequal_shards":
               "rank 0: global_mean of unequal shards called dist.all_reduce 2 times, expected 1"},
        keeps=["test_global_mean_basic"]),
    Bug("global_mean", "hidden_only_bug_returns_a_tensor",
        patch=[("    return (totals[0] / totals[1]).item()\n", "    return totals[0] / totals[1]\n")],
        loses={"test_global_mean_unequal_shards": "should return a Python float"}),
    Bug(None, "edits_the_read_only_test_cells",
        cells={"test_my_slice_basic": "pass", "test_my_slice_edge_cases": "pass"},
        loses={"test_my_slice_basic": "NotImplementedError", "test_my_slice_edge_cases": "NotImplementedError"}),
    Bug("my_slice", "does_not_execute",
        patch=[("def my_slice(data):\n", "def my_slice(data)\n")],
        loses={"test_my_slice_basic": "NameError"}),
    Bug("my_slice", "spins_forever",  # a hung learner function: the launcher's deadline stops it
        patch=[(SLICE, "    while True:\n"
                       "        pass\n")],
        # one cell: each waits for the whole deadline (the edge-case cell would say the same)
        loses={"test_my_slice_basic": "did not finish within the 15 s deadline"}),
    Bug("global_mean", "waits_for_a_message_nobody_sends",
        patch=[(TOTALS + MEAN, "    buffer = torch.zeros(1)\n"
                               "    dist.recv(buffer, src=(dist.get_rank() + 1) % dist.get_world_size())\n"
                               "    return buffer.item()\n")],
        loses={"test_global_mean_basic": "global_mean deadlocked: ranks 0, 1, 2 and 3 of 4 waited"}),
]
