"""The communication recorder sees every route to a collective, and counts p2p bytes."""

import pytest
import torch
import torch.distributed as dist

from dpcourse import LaunchError, launch
from dpcourse.comm.recorder import CommRecorder, recorded


def exchange():
    other = 1 - dist.get_rank()
    t = torch.ones(8)  # 32 bytes
    if dist.get_rank() == 0:
        dist.send(t, other)
        dist.recv(t, other)
    else:
        dist.recv(t, other)
        dist.send(t, other)
    work = dist.isend(torch.ones(2, dtype=torch.float64), other)
    dist.irecv(torch.zeros(2, dtype=torch.float64), other).wait()
    work.wait()
    return t


def test_p2p_calls_are_counted_with_peer_and_bytes():
    results = launch(recorded, 2, exchange, p2p_only=True)
    for rank, (_, ops) in enumerate(results):
        assert [o.op for o in ops if o.op == "send"] == ["send", "send"]
        assert sum(o.nbytes for o in ops if o.op == "send") == 32 + 16
        assert {o.peer for o in ops} == {1 - rank}


BYPASSES = {
    "dist.all_reduce": lambda t: dist.all_reduce(t),
    "async dist.all_reduce": lambda t: dist.all_reduce(t, async_op=True).wait(),
    "group.WORLD.allreduce": lambda t: dist.group.WORLD.allreduce([t]).wait(),
    "_get_default_group().allreduce": lambda t: dist.distributed_c10d._get_default_group().allreduce(
        [t]).wait(),
    "dist.broadcast": lambda t: dist.broadcast(t, 0),
    "dist.all_gather": lambda t: dist.all_gather([torch.zeros_like(t), torch.zeros_like(t)], t),
    "dist.reduce_scatter_tensor": lambda t: dist.reduce_scatter_tensor(torch.zeros(1), t),
}


def call_forbidden(name):
    with CommRecorder(p2p_only=True, exercise="ring_all_reduce"):
        BYPASSES[name](torch.ones(2))


@pytest.mark.parametrize("name", sorted(BYPASSES))
def test_every_route_to_a_collective_is_caught(name):
    with pytest.raises(LaunchError, match="ring_all_reduce called the collective"):
        launch(call_forbidden, 2, name, group_timeout=5)


def timed_all_reduces():
    with CommRecorder() as rec:
        for _ in range(3):
            dist.all_reduce(torch.ones(4))
    return rec.ops


def test_collectives_are_recorded_in_order_with_timestamps():
    ops = launch(timed_all_reduces, 2)[0]
    assert [o.op for o in ops] == ["all_reduce"] * 3
    assert all(o.nbytes == 16 for o in ops)
    assert ops[0].start <= ops[0].end <= ops[1].start <= ops[2].start
