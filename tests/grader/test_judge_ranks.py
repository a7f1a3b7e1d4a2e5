"""The grader's sandboxed ranks and message router, on their own (autograder/dpgrader/judge/ranks.py).

What notebooks rely on under the judge must behave as under gloo: messages, collectives on
sub-groups, a deadlock that fails with a diagnosis instead of passing silently, DDP with its comm
hooks and async futures (torch's own PowerSGD hook included), and the router's log of every call.
"""

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from dpcourse import launch
from dpcourse.runtime.launcher import launch_options, observed_traffic
from dpgrader.judge.ranks import RankPool

pytestmark = pytest.mark.slow
# The sandboxes cannot import this file (tests are not in them): its functions travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def pool():
    pool = RankPool([], sandboxed=True, prestart=1)
    with pool.installed():
        yield pool
    pool.close()


def ring_and_groups():
    rank, world = dist.get_rank(), dist.get_world_size()
    left = torch.empty(2)
    works = [
        dist.irecv(left, (rank - 1) % world),
        dist.isend(torch.full((2,), float(rank)), (rank + 1) % world),
    ]
    for work in works:
        work.wait()
    pair = dist.new_group([0, 1]), dist.new_group([2, 3])
    mine = pair[rank // 2]
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=mine)
    gathered = [torch.empty(1) for _ in range(2)]
    dist.all_gather(gathered, torch.tensor([float(rank)]), group=mine)
    return left, total, torch.cat(gathered)


def test_messages_and_collectives_on_sub_groups_and_the_routers_log(pool):
    results = launch(ring_and_groups, 4)
    for rank, (left, total, gathered) in enumerate(results):
        pair = [0, 1] if rank < 2 else [2, 3]
        assert left.tolist() == [float((rank - 1) % 4)] * 2
        assert total.item() == float(sum(pair)) and gathered.tolist() == [float(r) for r in pair]
    traffic = observed_traffic()
    assert [op.op for op in traffic[0]] == ["recv", "send", "all_reduce", "all_gather"]
    assert traffic[0][1].world_peer == 1 and traffic[0][1].nbytes == 8 and traffic[0][2].group == (0, 1)


def everybody_receives_first():
    x = torch.zeros(3)
    dist.recv(x, (dist.get_rank() + 1) % 2)
    return x


def test_a_deadlock_fails_with_a_diagnosis_within_the_group_timeout(pool):
    with pytest.raises(Exception, match="deadlock|waiting") as error:
        launch(everybody_receives_first, 2, group_timeout=2)
    assert "recv" in str(error.value)


def receive_from_minus_one():
    x = torch.zeros(3)
    dist.recv(x, dist.get_rank() - 1)  # rank 0 asks rank -1: no such rank (not "the last one")
    return x


def test_a_peer_outside_the_group_is_refused_as_under_gloo_not_read_as_the_last_rank(pool):
    with pytest.raises(Exception, match=r"PeerError: recv from rank -1: there is no rank -1 \(the ranks "
                                        r"are 0 to 1\)"):
        launch(receive_from_minus_one, 2, group_timeout=2)


def requests_before_and_after_wait():
    import time

    if dist.get_rank() == 0:
        request = dist.isend(torch.ones(4), 1)
        time.sleep(0.3)  # long received by then
        before = request.is_completed()
        request.wait()
        return before, request.is_completed()
    x = torch.zeros(4)
    request = dist.irecv(x, 0)
    time.sleep(0.3)
    before = request.is_completed()
    request.wait()
    return before, request.is_completed()


def test_send_and_recv_requests_say_completed_only_once_waited_for_as_gloos_do(pool):
    # gloo: False, then True (measured); code that prunes requests by is_completed() keeps them alike
    assert launch(requests_before_and_after_wait, 2) == [(False, True), (False, True)]


def gather_into_a_stacked_output():
    import warnings

    warnings.simplefilter("ignore", FutureWarning)
    dist.all_gather_into_tensor(torch.empty(2, 3, 2), torch.ones(3, 2))


def test_a_tensor_layout_gloo_refuses_is_refused_under_the_grader_too(pool):
    # the router could compute it, but gloo refuses it in a notebook: the grader must not accept more
    with pytest.raises(Exception, match=r"all_gather_into_tensor on 2 ranks: its output must hold the 2 "
                                        r"pieces one after the other along dim 0, shape \(6, 2\)"):
        launch(gather_into_a_stacked_output, 2, group_timeout=2)


def reduce_in_place():
    t = torch.ones(2)
    dist.all_reduce(t)
    return t


def test_point_to_point_launches_refuse_collectives(pool):
    with launch_options(p2p_only=True, exercise="the exercise"), pytest.raises(Exception, match="collective"):
        launch(reduce_in_place, 2)


def ddp_with_hooks():
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    for step in range(3):
        ddp(torch.randn(8, 16) * (dist.get_rank() + 1 + step)).sum().backward()
    future = dist.all_reduce(torch.ones(2), async_op=True).get_future()
    return [p.grad.clone() for p in model.parameters()], future.wait()[0]


def test_ddp_with_torchs_powersgd_hook_and_async_futures(pool):
    (grads0, summed0), (grads1, summed1) = launch(ddp_with_hooks, 2)
    assert summed0.tolist() == summed1.tolist() == [2.0, 2.0]
    for g0, g1 in zip(grads0, grads1, strict=True):
        assert torch.equal(g0, g1)  # the hook's result is the same on every rank


def test_a_test_function_that_reads_a_records_ops_attribute_travels(pool):
    class Record:
        ops = [1, 2, 3]

    def count(record):
        return len(record.ops) + int(torch.ones(1).item())

    assert launch(count, 1, Record()) == [4]


def every_collective(ops):
    """Each collective torch offers on gloo, on rank-dependent float64 values: what it returned."""
    import warnings

    warnings.simplefilter("ignore")  # torch's deprecation warnings of the *_tensor forms
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.arange(4 * world, dtype=torch.float64) * (rank + 1) + rank
    out = {}
    for name in ops:
        op = getattr(dist.ReduceOp, name)
        t = x.clone()
        dist.all_reduce(t, op=op)
        out[f"all_reduce {name}"] = t
        shard = torch.empty(4, dtype=torch.float64)
        dist.reduce_scatter_tensor(shard, x.clone(), op=op)
        out[f"reduce_scatter_tensor {name}"] = shard
        pieces = [torch.empty(4, dtype=torch.float64) for _ in range(world)]
        dist.reduce_scatter(pieces[0], list(x.clone().chunk(world)), op=op)
        out[f"reduce_scatter {name}"] = pieces[0]
        t = x.clone()
        dist.reduce(t, dst=0, op=op)
        if rank == 0:
            out[f"reduce {name}"] = t
    gathered = torch.empty(4 * world * world, dtype=torch.float64)
    dist.all_gather_into_tensor(gathered, x)
    out["all_gather_into_tensor"] = gathered
    listed = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(listed, x)
    out["all_gather"] = torch.cat(listed)
    t = x.clone()
    dist.broadcast(t, src=world - 1)
    out["broadcast"] = t
    received = torch.empty(4 * world, dtype=torch.float64)
    dist.all_to_all_single(received, x)
    out["all_to_all_single"] = received
    splits = [r + 1 for r in range(world)]  # uneven: rank r sends r' + 1 values to rank r'
    sent = torch.arange(sum(splits), dtype=torch.float64) + 100 * rank
    uneven = torch.empty(world * (rank + 1), dtype=torch.float64)
    dist.all_to_all_single(uneven, sent, output_split_sizes=[rank + 1] * world, input_split_sizes=splits)
    out["all_to_all_single uneven"] = uneven
    outs = [torch.empty(2, dtype=torch.float64) for _ in range(world)]
    dist.all_to_all(outs, list(x[:2 * world].chunk(world)))
    out["all_to_all"] = torch.cat(outs)
    if rank == 0:
        gather = [torch.empty_like(x) for _ in range(world)]
        dist.gather(x, gather, dst=0)
        out["gather"] = torch.cat(gather)
    else:
        dist.gather(x, dst=0)
    t = torch.empty(4, dtype=torch.float64)
    dist.scatter(t, list(x.chunk(world)) if rank == 0 else None, src=0)
    out["scatter"] = t
    objects = [None] * world
    dist.all_gather_object(objects, {"rank": rank})
    out["all_gather_object"] = [o["rank"] for o in objects]
    dist.barrier()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_every_collective_on_gloo_gives_the_same_under_the_grader(pool, world):
    """A learner's collective works while graded exactly as in the notebook: the router's results equal
    gloo's, for every reduction gloo offers (AVG included) and every collective form."""
    from dpcourse.runtime import launcher

    ops = ["SUM", "AVG", "PRODUCT", "MIN", "MAX"]
    routed = launch(every_collective, world, ops)
    launcher.use_runner(None)
    try:
        on_gloo = launch(every_collective, world, ops)
    finally:
        launcher.use_runner(pool)
    for rank in range(world):
        assert routed[rank].keys() == on_gloo[rank].keys()
        for name, want in on_gloo[rank].items():
            got = routed[rank][name]
            same = torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want
            assert same, f"rank {rank}, {name}: under the grader {got}, on gloo {want}"


def tensor_collectives():
    """torch 2.13's tensor forms of the collectives (notebook 12): all_gather_single and
    reduce_scatter_single along dim 0, and all_to_all_single with uneven splits, some empty."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gathered = torch.empty(2 * world, 3)
    dist.all_gather_single(gathered, torch.full((2, 3), float(rank)))
    scattered = torch.empty(2, 3)
    dist.reduce_scatter_single(scattered, torch.arange(6.0 * world).reshape(2 * world, 3) * (rank + 1))
    sizes = [(rank + peer) % 3 for peer in range(world)]  # rows to each peer: 0, 1 or 2
    rows = torch.cat([torch.full((n, 2), float(10 * rank + peer)) for peer, n in enumerate(sizes)])
    incoming = [(peer + rank) % 3 for peer in range(world)]  # what each peer sends to this rank
    received = torch.empty(sum(incoming), 2)
    dist.all_to_all_single(received, rows, incoming, sizes)
    return gathered[:, 0], scattered, received[:, 0]


def test_tensor_collectives_and_uneven_all_to_all_match_gloo(pool):
    world = 3
    results = launch(tensor_collectives, world)
    total = sum(r + 1 for r in range(world))
    for rank, (gathered, scattered, received) in enumerate(results):
        assert gathered.tolist() == [float(r) for r in range(world) for _ in range(2)]
        whole = torch.arange(6.0 * world).reshape(2 * world, 3) * total
        assert torch.equal(scattered, whole[2 * rank:2 * rank + 2])
        assert received.tolist() == [float(10 * peer + rank) for peer in range(world)
                                     for _ in range((peer + rank) % 3)]
    ops = [(op.op, op.nbytes) for op in observed_traffic()[0]]
    assert ops[:2] == [("all_gather_into_tensor", 2 * 3 * 4), ("reduce_scatter_tensor", 6 * world * 4)]
    assert ops[2] == ("all_to_all_single", sum(r % 3 for r in range(world)) * 2 * 4)


def talk_through_proc():
    """Writes a secret into its process name (prctl(PR_SET_NAME)) and its command line (the argv memory
    /proc/<pid>/cmdline shows), then looks for its peer's in every /proc/<pid>/comm and cmdline it sees."""
    import ctypes
    import os
    import time

    rank = dist.get_rank()
    mine, theirs = f"secret{rank}x", f"secret{1 - rank}x"
    libc = ctypes.CDLL(None)
    libc.prctl(15, mine.encode(), 0, 0, 0)  # PR_SET_NAME
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    arg_start, arg_end = int(fields[45]), int(fields[46])  # the stat fields 48 and 49
    ctypes.memmove(arg_start, mine.encode().ljust(arg_end - arg_start, b"\0")[:arg_end - arg_start],
                   arg_end - arg_start)
    found, end = set(), time.monotonic() + 1.5
    while time.monotonic() < end and not found:
        for pid in (p for p in os.listdir("/proc") if p.isdigit()):
            for name in ("comm", "cmdline"):
                try:
                    with open(f"/proc/{pid}/{name}", "rb") as f:
                        if theirs.encode() in f.read():
                            found.add(name)
                except OSError:
                    pass
        time.sleep(0.05)
    with open("/proc/self/cmdline", "rb") as f:
        wrote = mine.encode() in f.read()
    return sorted(found), wrote, sorted(int(p) for p in os.listdir("/proc") if p.isdigit())


def test_ranks_of_one_launch_cannot_read_each_others_process_names_or_command_lines(pool):
    """Each rank is the first process of a pid namespace of its own with its own /proc (as root; without
    root each rank index has a sandbox of its own): what a rank writes into its name or command line is
    seen by no peer, and a rank sees no process but its own."""
    from dpgrader.judge.sandbox import can_isolate_ranks

    for rank, (found, wrote, visible) in enumerate(launch(talk_through_proc, 2)):
        assert wrote, "the rank could not write its own command line: the attack was not tried"
        assert found == [], f"rank {rank} read its peer's secret from /proc/<pid>/{found}"
        # itself only (pid 1); in a sandbox of its own: bubblewrap's init (1), the zygote (2) and itself
        assert visible == [1] if can_isolate_ranks() else (visible[:2] == [1, 2] and len(visible) == 3), (
            f"rank {rank} sees {visible}")


def look_around(paths):
    """What of `paths` this rank can read, and whether anything of the grader's environment reached it."""
    import os
    import sys

    seen = []
    for what, path in paths.items():
        try:
            found = open(path, "rb").read(1) if os.path.isfile(path) else set(os.listdir(path))
        except OSError:
            continue
        if what == "home":  # but folders on the way to what is shown: Python (pyenv under /root), the course
            shown = (sys.base_prefix, sys.prefix, paths["course"])
            found = {e for e in found if not any(p.startswith(os.path.join(path, e) + os.sep) for p in shown)}
        if found:
            seen.append(what)
    if any("planted" in value for value in os.environ.values()):
        seen.append("the grader's environment")
    return sorted(seen)


def test_a_rank_sees_only_the_course_and_the_environment(pool, tmp_path, monkeypatch):
    """With root or without (the layout a learner's `make grade` and a hub without a grading service get):
    a rank reads the released course, and nothing of the solutions, the hidden checks, the submissions,
    the tests, the git history, a file next to the checkout, a home folder or the grader's environment."""
    import os
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    planted = repo.parent / f".dpcourse-test-rank-look-{os.getpid()}"
    planted.write_text("planted")
    monkeypatch.setenv("DPCOURSE_PLANTED", "planted")  # the judge's environment; a rank's is fresh anyway
    paths = {"solutions": str(repo / "solutions"), "hidden checks": str(repo / "autograder" / "dpgrader"),
             "submitted": str(repo / "autograder" / "submitted"), "tests": str(repo / "tests"),
             "git": str(repo / ".git"), "next to the checkout": str(planted), "home": os.path.expanduser("~"),
             "course": str(repo / "course" / "dpcourse" / "__init__.py")}
    try:
        seen = launch(look_around, 2, paths)
    finally:
        planted.unlink()
    assert seen == [["course"], ["course"]], seen


def talk_through_locks_and_terminals():
    """Rank 0 takes locks on a file every rank can read (a byte range is 64 bits a lock: F_GETLK tells
    a peer where it is), opens a pseudo-terminal (a peer sees /dev/pts/N appear), drops the file's pages
    from the page cache and asks whether one is cached without reading it; rank 1 looks."""
    import fcntl
    import os
    import struct
    import time

    rank, tried = dist.get_rank(), {}
    fd = os.open("/etc/os-release", os.O_RDONLY)
    if rank == 0:
        for name, call in (("fcntl", lambda: fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB, 1, 123456789)),
                           ("flock", lambda: fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)),
                           ("ofd", lambda: fcntl.fcntl(fd, 37, struct.pack("hhqqi", fcntl.F_RDLCK, 0, 7, 1,
                                                                           0))),
                           ("pty", lambda: os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY)),
                           ("fadvise", lambda: os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)),
                           ("nowait", lambda: os.preadv(fd, [bytearray(8)], 0, os.RWF_NOWAIT))):
            try:
                call()
                tried[name] = "done"
            except OSError as exc:
                tried[name] = exc.strerror
        time.sleep(1.0)
    else:
        time.sleep(0.5)
        try:
            held = fcntl.fcntl(fd, fcntl.F_GETLK, struct.pack("hhqqi", fcntl.F_WRLCK, 0, 0, 0, 0))
            tried["seen lock"] = struct.unpack("hhqqi", held)[2]
        except OSError as exc:
            tried["seen lock"] = exc.strerror
        tried["seen terminals"] = sorted(os.listdir("/dev/pts")) if os.path.isdir("/dev/pts") else []
    tried["fcntl still works"] = fcntl.fcntl(fd, fcntl.F_GETFL) >= 0
    return tried


def test_ranks_share_no_file_locks_and_no_pseudo_terminals(pool):
    """As root: a rank may take no file lock (a seccomp filter: flock and fcntl's lock commands fail with
    EPERM, fcntl's others work), set or query the page cache of a shared file (fadvise, RWF_NOWAIT) and
    has no pseudo-terminals, so none of these is a way to talk to a peer."""
    from dpgrader.judge.sandbox import can_isolate_ranks

    if not can_isolate_ranks():
        pytest.skip("ranks are filtered and given their own /dev/pts by the zygote as root only")
    first, second = launch(talk_through_locks_and_terminals, 2)
    refused = ("fcntl", "flock", "ofd", "fadvise", "nowait")
    assert {k: first[k] for k in refused} == dict.fromkeys(refused, "Operation not permitted"), first
    assert first["pty"] == "No such file or directory" and first["fcntl still works"], first
    assert second["seen lock"] == "Operation not permitted" and second["seen terminals"] == [], second


def what_a_sent_block_costs(rounds):
    """A rank's own view of its memory around point-to-point requests (PeakMemory, notebook 12's ring
    attention check): each round sends a block and receives one, keeps the send request past its wait,
    and drops the block's name. Returns the peak bytes, the most blocks alive at once, and whether the
    sent block was still alive while its request lived, and freed once the request was dropped."""
    import weakref

    from dpcourse.topics.sequence.measure import PeakMemory

    peer, rows, kept, freed = 1 - dist.get_rank(), 4096, [], []
    with PeakMemory() as peak:
        block = torch.full((rows,), float(dist.get_rank()), dtype=torch.float64)
        held = [None]  # the last round's send request (which keeps its block alive), then None
        alive = None
        for _ in range(rounds):
            arriving = torch.empty(rows, dtype=torch.float64)  # 3 blocks alive: block, arriving, held's
            held[0] = None
            if alive is not None:
                freed.append(alive() is None)
            send, recv = dist.isend(block, peer), dist.irecv(arriving, peer)
            recv.wait()
            send.wait()
            alive = weakref.ref(block)
            block = arriving  # the sent block is now referred to by its request only
            kept.append(alive() is not None)
            held[0], send = send, None
    return peak.peak_bytes, peak.most_alive[rows * 8], all(kept), all(freed)


def test_a_rank_holds_under_the_router_what_it_holds_under_gloo(pool):
    """The router's memory is the rank's memory: a request keeps its tensor exactly as long as gloo's does
    (while the request object lives, waited for or not), the frame's copy of a sent block is the grader's
    (made outside the rank's dispatch modes, invisible to its PeakMemory), and once a wait returns no thread
    of the router still holds a buffer of the rank's, however the threads are scheduled (50 rounds)."""
    from dpcourse.runtime import launcher

    routed = launch(what_a_sent_block_costs, 2, 50)
    launcher.use_runner(None)
    try:
        on_gloo = launch(what_a_sent_block_costs, 2, 50)
    finally:
        launcher.use_runner(pool)
    block = 4096 * 8
    # gloo, measured: the block computed with, the one arriving and the one the kept request holds
    assert on_gloo == [(3 * block, 3, True, True)] * 2, on_gloo
    assert routed == on_gloo


def gather_a_list_sized_by_the_world():
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pieces = [torch.empty(3) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, torch.ones(3), group=pairs[dist.get_rank() // 2])


def test_a_tensor_list_sized_by_the_world_is_refused_under_the_grader_as_under_gloo(pool):
    # the router once answered "expected 4 tensor(s) back, got 2": its own bookkeeping, not the mistake
    message = (r"all_gather on a group of 2 ranks: its output list holds 4 "
               r"tensors, one per rank of the group is needed \(2\) -- its output list is sized for the "
               r"world's 4 ranks")
    with pytest.raises(Exception, match=message):
        launch(gather_a_list_sized_by_the_world, 4, group_timeout=2)
