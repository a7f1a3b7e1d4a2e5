"""comm.volume: the bytes a rank sends for each recorded call, and the recorder's records it reads
(input bytes and the group, for every kind of collective)."""

import pytest
import torch
import torch.distributed as dist

from dpcourse import launch
from dpcourse.comm.recorder import CommOp, CommRecorder
from dpcourse.comm.volume import all_to_all_traffic, bytes_sent, ring_bytes, volume_by_op


def op(name, nbytes, group=(0, 1, 2, 3)):
    return CommOp(name, None, nbytes, 0.0, 0.0, group)


def test_ring_bytes_of_each_collective():
    S = 400.0
    assert ring_bytes(op("all_reduce", S)) == 2 * 3 / 4 * S
    assert ring_bytes(op("reduce_scatter", S)) == 3 / 4 * S  # recorded: the whole input
    assert ring_bytes(op("all_gather", S / 4)) == 3 / 4 * S  # recorded: this rank's chunk
    assert ring_bytes(op("broadcast", S)) == ring_bytes(op("reduce", S)) == 3 / 4 * S
    assert ring_bytes(CommOp("send", 1, 64, 0.0, 0.0, (0, 1))) == 64
    assert ring_bytes(CommOp("recv", 1, 64, 0.0, 0.0, (0, 1))) == 0
    assert ring_bytes(op("all_reduce", S, group=(2,))) == 0  # a group of one sends nothing
    assert ring_bytes(op("all_reduce", S, group=None), world_size=2) == S


def test_unknown_ops_and_missing_groups_are_refused():
    with pytest.raises(ValueError, match="no ring traffic model for 'gather'"):
        ring_bytes(op("gather", 8))
    with pytest.raises(ValueError, match="pass world_size"):
        ring_bytes(op("all_reduce", 8, group=None))


def test_an_all_to_all_sends_all_but_its_own_share():
    """Each rank keeps 1/N of its input and sends the rest, one message per peer (notebook 12's Ulysses and
    experts price theirs with all_to_all_traffic)."""
    assert ring_bytes(op("all_to_all_single", 800)) == 600.0  # a group of 4: (N-1)/N of the input
    assert all_to_all_traffic(800, 4, calls=2) == (6, 600.0) and all_to_all_traffic(800, 1) == (0, 0.0)


def test_totals_by_op():
    ops = [op("all_gather", 100), op("reduce_scatter", 400), op("all_gather", 100)]
    assert volume_by_op(ops) == {"all_gather": 600.0, "reduce_scatter": 300.0}
    assert bytes_sent(ops) == 900.0


def collectives():
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group([0, 2])
    x = torch.ones(4, dtype=torch.float64)  # 32 bytes
    with CommRecorder() as rec:
        dist.all_gather([torch.zeros(4, dtype=torch.float64) for _ in range(world)], x)
        dist.all_gather_single(torch.zeros(4 * world, dtype=torch.float64), x)
        dist.reduce_scatter(torch.zeros(4, dtype=torch.float64), [x.clone() for _ in range(world)])
        dist.reduce_scatter_single(torch.zeros(4, dtype=torch.float64), x.repeat(world))
        if rank in (0, 2):
            dist.all_reduce(x, group=group)
    return [(o.op, o.nbytes, o.group) for o in rec.ops]


def test_the_recorder_counts_input_bytes_and_names_the_group_of_every_collective():
    records = launch(collectives, 3, group_timeout=5)
    everyone = (0, 1, 2)
    assert records[1] == [("all_gather", 32, everyone), ("all_gather_into_tensor", 32, everyone),
                          ("reduce_scatter", 96, everyone), ("reduce_scatter_tensor", 96, everyone)]
    assert records[2][-1] == ("all_reduce", 32, (0, 2))
    ops = [CommOp(name, None, nbytes, 0.0, 0.0, group) for name, nbytes, group in records[0][:4]]
    assert bytes_sent(ops) == 4 * 2 / 3 * 96  # each: (N-1)/N of the 96-byte vector
