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


def functional_and_dtensor_collectives():
    """A functional all-reduce on the group of ranks {0, 1} / {2, 3}, then DTensor's Partial -> Replicate."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]
    x = torch.ones(3, dtype=torch.float64)
    with CommRecorder() as rec:
        total = funcol.all_reduce(x, "sum", tp.get_group()) + 0
        replicated = DTensor.from_local(x, tp, [Partial()], run_check=False).redistribute(tp, [Replicate()])
        replicated = replicated.to_local() + 0
    return rec.ops, total, replicated


def test_functional_collectives_and_dtensor_redistribution_are_recorded_with_their_group():
    results = launch(functional_and_dtensor_collectives, 4, group_timeout=5)
    for rank, (ops, total, replicated) in enumerate(results):
        assert [o.op for o in ops] == ["all_reduce", "all_reduce"], ops
        assert all(o.nbytes == 24 for o in ops)
        assert {o.group for o in ops} == {(0, 1) if rank < 2 else (2, 3)}
        assert total.tolist() == replicated.tolist() == [2.0, 2.0, 2.0]


def functional_all_reduce_in_a_p2p_exercise():
    import torch.distributed._functional_collectives as funcol

    with CommRecorder(p2p_only=True, exercise="ring_all_reduce"):
        funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD) + 0


def test_functional_collectives_are_forbidden_in_p2p_exercises():
    with pytest.raises(LaunchError, match=r"ring_all_reduce called the collective `all_reduce` "
                                          r"\(_c10d_functional::all_reduce\)"):
        launch(functional_all_reduce_in_a_p2p_exercise, 2, group_timeout=5)


def gathers_and_scatters():
    """Collectives with separate outputs, on the group of ranks {1, 2} of 3."""
    group = dist.new_group([1, 2])
    if dist.get_rank() == 0:
        return []
    x = torch.ones(3, dtype=torch.float64)
    with CommRecorder() as rec:
        dist.all_gather([torch.zeros_like(x), torch.zeros_like(x)], x, group=group)
        dist.reduce_scatter(torch.zeros(3), [torch.ones(3), torch.ones(3)], group=group)
        dist.all_to_all([torch.zeros(2), torch.zeros(2)], [torch.ones(2), torch.ones(2)], group=group)
    return rec.ops


def test_collectives_with_outputs_record_their_inputs_bytes_and_their_group():
    for ops in launch(gathers_and_scatters, 3, group_timeout=5)[1:]:
        assert [(o.op, o.nbytes, o.group) for o in ops] == [
            ("all_gather", 24, (1, 2)), ("reduce_scatter", 24, (1, 2)), ("all_to_all", 16, (1, 2))]


def receive_from(peer):
    """A receive from a rank that does not exist, under the recorder: refused before gloo sees it."""
    with CommRecorder(p2p_only=True, exercise="ring"):
        dist.recv(torch.zeros(2), peer)


@pytest.mark.parametrize("peer", [-1, 2])
def test_a_peer_outside_the_group_is_refused_before_the_backend(peer):
    # gloo given rank -1 can crash the process ("double free or corruption"); the router would read -1
    # as the last rank: neither may see it
    with pytest.raises(LaunchError, match=rf"PeerError: recv from rank {peer}: there is no rank "
                                          rf"{peer} \(the ranks are 0 to 1\)"):
        launch(receive_from, 2, peer, group_timeout=5)


def gather_stacked(kind):
    import warnings

    warnings.simplefilter("ignore", FutureWarning)  # torch 2.13 calls both names deprecated
    n = dist.get_world_size()
    with CommRecorder(exercise="gather"):
        if kind == "stacked":
            dist.all_gather_into_tensor(torch.empty(n, 3, 2), torch.ones(3, 2))
        elif kind == "flat input":
            dist.reduce_scatter_tensor(torch.empty(3, 2), torch.ones(n * 6))
        else:
            out = torch.empty(n * 3, 2)
            dist.all_gather_into_tensor(out, torch.ones(3, 2))
            dist.reduce_scatter_tensor(torch.empty(3, 2), out)
    return "ok"


@pytest.mark.parametrize("kind, message", [
    ("stacked", r"all_gather_into_tensor on 2 ranks: its output must hold the 2 pieces one after the other "
                r"along dim 0, shape \(6, 2\) for pieces of shape \(3, 2\); got \(2, 3, 2\)"),
    ("flat input", r"reduce_scatter_tensor on 2 ranks: its input must hold the 2 pieces one after the other "
                   r"along dim 0, shape \(6, 2\) for pieces of shape \(3, 2\); got \(12,\)"),
])
def test_a_tensor_layout_gloo_refuses_or_crashes_on_is_refused_first_with_the_layout_it_takes(kind, message):
    # gloo raises "invalid tensor size" for the first and kills the process for the second (measured)
    with pytest.raises(LaunchError, match=message):
        launch(gather_stacked, 2, kind, group_timeout=5)
    assert launch(gather_stacked, 2, "concatenated") == ["ok", "ok"]


def sized_by_the_world(kind):
    import warnings

    warnings.simplefilter("ignore", FutureWarning)
    world, pairs = dist.get_world_size(), [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = pairs[dist.get_rank() // 2]
    with CommRecorder(exercise="sized"):
        if kind == "gather output":
            dist.all_gather_into_tensor(torch.empty(world * 3, 2), torch.ones(3, 2), group=group)
        else:  # the output of a reduce-scatter of 4 rows over the pair: 2 rows, not 4 / world = 1
            dist.reduce_scatter_tensor(torch.empty(4 // world, 2), torch.ones(4, 2), group=group)
    return "ok"


@pytest.mark.parametrize("kind, message", [
    ("gather output", r"all_gather_into_tensor on 2 ranks: its output must hold the 2 pieces .* got "
                      r"\(12, 2\) -- its output is sized for the world's 4 ranks "
                      r"\(dist.get_world_size\(\)\), not for the group's 2 \(dist.get_world_size\(group\)\)"),
    ("scatter output", r"reduce_scatter_tensor on 2 ranks: its output must be one of the 2 equal pieces of "
                       r"its input \(4, 2\) along dim 0, shape \(2, 2\); got \(1, 2\) -- its output is sized "
                       r"for the world's 4 ranks"),
])
def test_a_buffer_sized_by_the_world_on_a_group_is_named_so_and_blamed_on_itself(kind, message):
    with pytest.raises(LaunchError, match=message):
        launch(sized_by_the_world, 4, kind, group_timeout=5)


def lists_sized_by_the_world(kind):
    world, pairs = dist.get_world_size(), [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = pairs[dist.get_rank() // 2]
    with CommRecorder(exercise="lists"):
        if kind == "all_gather":
            dist.all_gather([torch.empty(3) for _ in range(world)], torch.ones(3), group=group)
        elif kind == "reduce_scatter":
            dist.reduce_scatter(torch.empty(3), [torch.ones(3) for _ in range(world)], group=group)
        else:
            dist.all_to_all([torch.empty(3) for _ in range(world)], [torch.ones(3) for _ in range(world)],
                            group=group)
    return "ok"


@pytest.mark.parametrize("kind, role", [("all_gather", "output"), ("reduce_scatter", "input"),
                                        ("all_to_all", "output")])
def test_a_tensor_list_sized_by_the_world_on_a_group_is_named_so(kind, role):
    # gloo: "invalid input tensor list size, must be world size" (of the group) and the like; the router
    # would answer with fewer tensors than asked: both sides refuse the call first, saying why
    message = (rf"{kind} on a group of 2 ranks: its {role} list holds 4 tensors, "
               rf"one per rank of the group is needed \(2\) -- its {role} list is sized for the world's 4 "
               rf"ranks")
    with pytest.raises(LaunchError, match=message):
        launch(lists_sized_by_the_world, 4, kind, group_timeout=5)


def all_to_all_of(kind):
    rank = dist.get_rank()
    with CommRecorder(exercise="a2a"):
        if kind == "no splits":  # uneven, no split sizes: gloo's "enforce fail ... in->size == out->size"
            dist.all_to_all_single(torch.empty(4 - rank, 2), torch.ones(3 + rank, 2))
        elif kind == "sum":
            dist.all_to_all_single(torch.empty(4, 2), torch.ones(4, 2), [2, 2], [1, 2])
        elif kind == "entries":
            dist.all_to_all_single(torch.empty(4, 2), torch.ones(4, 2), [1, 1, 2], [2, 2])
    return "ok"


@pytest.mark.parametrize("kind, message", [
    ("no splits", r"all_to_all_single on 2 ranks without split sizes sends and receives 2 equal pieces: its "
                  r"input and its output must be the same size; got an input of shape \(3, 2\) and an output "
                  r"of shape \(4, 2\). For pieces of different sizes, pass output_split_sizes"),
    ("sum", r"input_split_sizes \[1, 2\] add up to 3 rows, and its input has 4 \(dim 0\)"),
    ("entries", r"output_split_sizes has 3 entries \[1, 1, 2\], one per rank of the group is needed \(2\)"),
])
def test_all_to_all_sizes_that_cannot_work_are_explained(kind, message):
    with pytest.raises(LaunchError, match=message):
        launch(all_to_all_of, 2, kind, group_timeout=5)


def test_splits_that_disagree_between_ranks_are_named_when_gloo_aborts():
    """Rank 0 sends 1 row to rank 1, which expects 2 from it: no rank can see it alone, and gloo aborts the
    receiving process ("Received data size doesn't match expected size", measured on torch 2.13); the
    launcher's report names the likely cause (a rank's report, built here as the launcher builds it)."""
    from dpcourse.runtime import failures, launcher

    rank = launcher.Rank(0, 1, -1, -1, -1, control=object())
    rank.exit_status, rank.output_tail = 6, [
        "terminate called after throwing an instance of 'gloo::EnforceNotMet'",
        "  what():  [enforce fail at gloo/transport/tcp/pair.cc:456] op.preamble.length <= op.nbytes. 16 vs "
        "8. Received data size doesn't match expected size. Is there a distributed collective mismatch?"]
    report = str(failures.describe_failure([rank], [], 5, 3))
    assert "killed by signal 6 (SIGABRT) -- gloo received a message of another size than the buffer" in report
    assert "output_split_sizes[j] must be rank j's input_split_sizes[i]" in report, report
