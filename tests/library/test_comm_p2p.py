"""comm.p2p: exercises run p2p-only under the recorder, each rank on its own tensor; deadlocks and
collectives become sentences; ring traffic is judged in bytes and steps."""

import time

import pytest
import torch
import torch.distributed as dist

from dpcourse import LaunchError
from dpcourse.comm.cases import Case, RankRun, run_cases
from dpcourse.comm.p2p import run_p2p, run_p2p_cases
from dpcourse.comm.recorder import CommOp
from dpcourse.comm.traffic import expect_ring_traffic
from dpcourse.reference.splits import chunk_bounds
from dpcourse.topics.collectives.checks import expect_all_reduced, expect_reduce_scattered
from markers import exercise


def shift(x, group=None):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    out = torch.empty_like(x)
    works = [dist.irecv(out, group=group, group_src=(rank - 1) % world),
             dist.isend(x, group=group, group_dst=(rank + 1) % world)]
    for work in works:
        work.wait()
    return out


def test_a_p2p_function_is_recorded_with_results_peers_and_bytes(no_orphans):
    inputs = [torch.full((3,), float(r)) for r in range(3)]
    calls = run_p2p(shift, inputs, exercise="shift")
    for c in calls:
        assert torch.equal(c.result, inputs[(c.rank - 1) % 3])
        assert [(o.op, o.world_peer, o.nbytes) for o in c.sends] == [("send", (c.rank + 1) % 3, 12)]
        assert c.group_rank == c.rank and c.group_size == 3


def test_groups_renumber_ranks_and_peers_are_named_by_world_rank():
    inputs = [torch.full((2,), float(r)) for r in range(4)]
    (calls,) = run_p2p_cases(shift, 4, [dict(inputs=inputs, groups=[[0, 2], [1, 3]])], exercise="shift")
    for c in calls:
        partner = {0: 2, 2: 0, 1: 3, 3: 1}[c.rank]
        assert torch.equal(c.result, inputs[partner])
        assert c.group_size == 2 and c.group_rank == c.group_members.index(c.rank)
        assert c.sends[0].world_peer == partner and c.sends[0].peer == c.group_members.index(partner)


def everybody_receives_first(x):
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.recv(x, (rank - 1) % world)
    dist.send(x, (rank + 1) % world)


def test_a_deadlock_ends_in_seconds_naming_every_rank_and_its_call(no_orphans):
    start = time.monotonic()
    with pytest.raises(AssertionError) as error:
        run_p2p(everybody_receives_first, [torch.ones(2)] * 3, exercise="ring", group_timeout=2)
    assert time.monotonic() - start < 10
    message = str(error.value)
    assert message.startswith("ring deadlocked: ranks 0, 1 and 2 of 3 waited 2 s")
    for rank in range(3):
        assert f"rank {rank}: blocked in recv from rank {(rank - 1) % 3}" in message


@pytest.mark.parametrize("route", ["dist.all_reduce", "_get_default_group().allreduce"])
def test_a_collective_by_any_route_fails_with_its_name(route):
    def uses_a_collective(x):
        if route == "dist.all_reduce":
            dist.all_reduce(x)
        else:
            dist.distributed_c10d._get_default_group().allreduce([x]).wait()

    with pytest.raises(AssertionError, match=r"my_sum called the collective `all_reduce`.*on ranks 0 and 1"):
        run_p2p(uses_a_collective, [torch.ones(2)] * 2, exercise="my_sum")


def test_a_bug_in_the_function_is_a_launch_error_naming_the_rank():
    def fails_on_rank_1(x):
        if dist.get_rank() == 1:
            raise IndexError("chunk 5 of 4")
        return x

    with pytest.raises(LaunchError, match="rank 1 of 2 raised IndexError: chunk 5 of 4"):
        run_p2p(fails_on_rank_1, [torch.ones(1)] * 2, exercise="f")


@pytest.mark.parametrize("length", [0, 1, 2, 3, 7, 10, 13])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_chunk_bounds_are_tensor_splits(length, world):
    flat = torch.arange(length)
    expected = [(int(c[0]), int(c[-1]) + 1) if c.numel() else None for c in flat.tensor_split(world)]
    bounds = chunk_bounds(length, world)
    assert [b if b[1] > b[0] else None for b in bounds] == expected
    assert sum(b - a for a, b in bounds) == length


def fake_calls(world, sends_per_rank):
    calls = []
    for rank in range(world):
        call = RankRun(rank, tuple(range(world)))
        call.ops = [CommOp("send", (rank + 1) % world, nbytes, 0.0, 0.0) for nbytes in sends_per_rank]
        calls.append(call)
    return calls


@exercise("ring_reduce_scatter", "ring_all_gather", "ring_all_reduce")
def test_ring_traffic_accepts_a_ring_and_names_the_overhead_of_a_whole_tensor_ring():
    def judge(world, sends, numel):
        expect_ring_traffic(fake_calls(world, sends), numel, element_size=4, phases=2, what="all-reduce")

    judge(4, [1000] * 6, 1000)
    judge(3, [12, 8, 8, 12], 7)
    with pytest.raises(AssertionError, match="rank 0 sent 2.0x the bytes of a ring all-reduce"):
        judge(4, [4000] * 3, 1000)
    with pytest.raises(AssertionError, match="rank 0's step 1 sent 4000 bytes to rank 1, more than one"):
        judge(2, [4000], 1000)
    with pytest.raises(AssertionError, match="rank 0 sent 8 messages: a ring all-reduce on 4 ranks takes 6"):
        judge(4, [500] * 8, 1000)


@exercise("ring_reduce_scatter", "ring_all_reduce")
def test_reduce_scatter_and_all_reduce_judgements_point_at_the_chunk():
    inputs = [torch.arange(4.0) * (r + 1) for r in range(2)]
    total = inputs[0] + inputs[1]
    calls = [RankRun(r, (0, 1), values={"expected": total.clone()}) for r in range(2)]
    calls[0].values["after"] = torch.tensor([0.0, 3.0, 2.0, 3.0])   # chunk 0 right
    calls[1].values["after"] = inputs[1].clone()                     # chunk 1 is the input: nothing added
    with pytest.raises(AssertionError, match="rank 1 .* its chunk 1 .* unchanged from this rank's input"):
        expect_reduce_scattered(calls, inputs, "rs")
    calls[1].values["after"] = torch.tensor([0.0, 3.0, 9.0, 9.0])
    with pytest.raises(AssertionError, match=r"rank 1: after ar, chunk 1 \(elements 2–3 of 4\)"):
        expect_all_reduced([calls[1], calls[1]], "ar")


class Watch:
    """A minimal watch a per-case function sets on its context: notes that it ran, and where the rank was."""

    def __init__(self, rank):
        self.rank, self.entered = rank, False

    def observed(self):
        return {"entered": self.entered, "rank": self.rank}

    def where(self):
        return f"watched rank {self.rank}, half-way"

    def hint(self, exc):
        return " -- a hint from the watch"


def watched_pairs(fn, rank_number, ctx):
    """Ranks 0 and 1 swap their rank numbers (rank 2 sits out: its part is None), watched."""
    watch = Watch(ctx.rank)
    ctx.observe, ctx.where, ctx.hint = watch.observed, watch.where, watch.hint
    watch.entered = True
    return {"result": fn(torch.tensor([float(rank_number)]), 1 - ctx.rank, **ctx.shared)}


def pairs(**shared):
    return Case(parts=[0, 1, None], shared=shared, label="swap")


def swap(x, peer, fail=False):
    if fail and dist.get_rank() == 0:
        raise KeyError("boom")
    out = torch.empty_like(x)
    works = [dist.irecv(out, peer), dist.isend(x, peer)]
    for work in works:
        work.wait()
    return out


def test_a_per_case_function_watches_the_call_and_ranks_sit_out(no_orphans):
    (calls,) = run_cases(watched_pairs, swap, 3, [pairs()], exercise="swap", p2p_only=True)
    assert [c.result.item() for c in calls[:2]] == [1.0, 0.0]
    assert calls[0].observed == {"entered": True, "rank": 0}
    assert calls[2].group_rank is None and calls[2].observed is None and not calls[2].ops


def test_an_error_under_a_watch_says_where_the_rank_was(no_orphans):
    with pytest.raises(LaunchError, match=r"swap on rank 0, watched rank 0, half-way: KeyError: 'boom' -- a"):
        run_cases(watched_pairs, swap, 3, [pairs(fail=True)], exercise="swap", p2p_only=True)


def receive_only(x, peer, fail=False):
    dist.recv(x, peer)


def test_describe_and_advice_word_a_deadlock_in_the_exercises_terms(no_orphans):
    with pytest.raises(AssertionError) as error:
        run_cases(watched_pairs, receive_only, 3, [pairs()], exercise="pair", p2p_only=True, group_timeout=2,
                  describe=lambda call, about: f"worker {call.rank}: {call.stuck}", advice="Send first.")[0]
    message = str(error.value)
    assert "worker 0: in recv from rank 1" in message and "worker 1: in recv from rank 0" in message
    assert message.endswith("Send first.") and "worker 2" not in message


def test_the_circle_advice_only_when_every_rank_waits_in_the_same_call():
    """'if every rank sends first' is said only when it is true; a wrong peer gets the peer advice."""
    from dpcourse.comm.cases import PEER_ADVICE, RING_ADVICE, deadlock_advice

    def call(rank, stuck):
        return RankRun(rank, (rank,), failure=("stuck", stuck) if stuck else None)

    all_send = [call(r, f"in send to rank {(r + 1) % 3}") for r in range(3)]
    assert deadlock_advice(all_send) == RING_ADVICE
    wrong_peer = [call(0, "in recv from rank 2"), call(1, None), call(2, "in recv from rank 1")]
    assert deadlock_advice(wrong_peer) == PEER_ADVICE
    mixed = [call(0, "in send to rank 1"), call(1, "in recv from rank 0 (`dist.recv(b, 0)`)")]
    assert deadlock_advice(mixed) == PEER_ADVICE


def test_a_function_returning_its_input_is_told_apart_from_a_copy():
    def same(x):
        return x if dist.get_world_size() == 1 else x

    def copy(x):
        return x.clone()

    assert run_p2p(same, [torch.ones(2)], exercise="same")[0].aliases_input
    assert not run_p2p(copy, [torch.ones(2)], exercise="copy")[0].aliases_input


def off_by_one(x):
    """Every rank receives from rank - 1 and sends to rank + 1, without the modulo."""
    rank = dist.get_rank()
    work = dist.isend(x, rank + 1)
    dist.recv(x, rank - 1)
    work.wait()
    return x


def test_a_peer_that_does_not_exist_is_named_on_every_rank_that_used_it(no_orphans):
    inputs = [torch.full((2,), float(r)) for r in range(3)]
    with pytest.raises(AssertionError) as error:
        run_p2p(off_by_one, inputs, exercise="shift", group_timeout=2)
    message = str(error.value)
    assert message.startswith("shift named a rank that does not exist in a send or recv, on ranks 0 and 2:")
    assert "rank 0: recv from rank -1: there is no rank -1 (the ranks are 0 to 2)" in message
    assert "rank 2: send to rank 3: there is no rank 3" in message and "rank 1:" not in message
