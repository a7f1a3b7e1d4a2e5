"""The rank launcher: results, failures named by rank, bounded hangs, no process left behind."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from conftest import REPO, is_running
from dpcourse import LaunchError, launch, resolve_backend

pytestmark = pytest.mark.usefixtures("no_orphans")


def rank_info(offset, scale=1):
    return (dist.get_rank(), dist.get_world_size(), offset * scale, os.environ["RANK"])


def summed_ranks():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_each_rank_returns_its_value_with_args_and_kwargs(world_size):
    results = launch(rank_info, world_size, 5, scale=3)
    assert results == [(r, world_size, 15, str(r)) for r in range(world_size)]


def test_collective_results_come_back_as_tensors():
    results = launch(summed_ranks, 3)
    assert all(torch.equal(t, torch.tensor([6.0])) for t in results)


def raises_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("rank one has bad data")
    buffer = torch.zeros(1)
    dist.recv(buffer, src=1)  # the victim: waits for rank 1, then sees its connection close


def test_the_rank_that_raised_is_the_culprit_not_its_victims():
    with pytest.raises(LaunchError) as info:
        launch(raises_on_rank_one, 3)
    error = info.value
    assert (error.rank, error.kind) == (1, "raised")
    message = str(error)
    assert message.startswith("rank 1 of 3 raised ValueError: rank one has bad data")
    assert "raises_on_rank_one" in message  # its traceback


def mutual_recv():
    buffer = torch.zeros(1)
    dist.recv(buffer, src=1 - dist.get_rank())


def test_a_recv_deadlock_ends_at_the_group_timeout_naming_both_ranks():
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(mutual_recv, 2, group_timeout=2, deadline=60)
    elapsed = time.monotonic() - start
    assert 1.5 < elapsed < 20, elapsed
    assert info.value.kind == "deadlock"
    assert info.value.ranks == [0, 1]
    assert "deadlock: ranks 0 and 1 of 2" in str(info.value)
    assert "rank 0 in recv" in str(info.value) and "rank 1 in recv" in str(info.value)


def spins_on_rank_one():
    if dist.get_rank() == 1:
        while True:
            spin_here = 1  # noqa: F841 - the line a stack dump should point at
    buffer = torch.zeros(1)
    dist.recv(buffer, src=1)


def test_a_rank_spinning_in_python_ends_at_the_deadline_with_where_it_was():
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(spins_on_rank_one, 2, deadline=3, group_timeout=60)
    assert time.monotonic() - start < 20
    error = info.value
    assert error.rank == 1
    assert "rank 1 of 2 never reached the communication" in str(error)
    assert "while True" in str(error) or "spin_here = 1" in str(error)  # from its stack
    assert "rank 0: stopped while running in recv" in str(error)


def test_a_spinning_rank_is_blamed_when_its_peer_times_out_first():
    with pytest.raises(LaunchError) as info:
        launch(spins_on_rank_one, 2, deadline=60, group_timeout=2)
    assert info.value.rank == 1
    assert "when rank 0 gave up after 2 s" in str(info.value)


def exits_on_rank_one():
    if dist.get_rank() == 1:
        os._exit(3)
    buffer = torch.zeros(1)
    dist.recv(buffer, src=1)


def test_a_rank_calling_os_exit_is_named_with_its_exit_code():
    with pytest.raises(LaunchError) as info:
        launch(exits_on_rank_one, 2)
    assert (info.value.rank, info.value.kind) == (1, "exited")
    assert "rank 1 of 2 exited with code 3" in str(info.value)


def unmatched_all_reduce():
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))


def test_a_collective_nobody_else_calls_is_reported():
    with pytest.raises(LaunchError) as info:
        launch(unmatched_all_reduce, 2, group_timeout=3)
    assert info.value.rank == 0
    assert str(info.value).startswith("rank 0 of 2 gave up after 3 s in all_reduce, waiting for rank 1, "
                                      "which had already returned")


def returns_at_once():
    return dist.get_rank()


def test_ranks_that_return_at_once_never_break_a_slower_peer():
    """A rank that exits early used to close its sockets while a peer was still connecting."""
    for _ in range(15):
        assert launch(returns_at_once, 4) == [0, 1, 2, 3]


def returns_a_lambda():
    return lambda: 1


def test_an_unpicklable_result_is_explained():
    with pytest.raises(LaunchError, match="cannot be sent back"):
        launch(returns_a_lambda, 2)


def chatty(lines):
    for i in range(lines):
        print(f"{dist.get_rank()}" * 300, i)
        print("to stderr", file=sys.stderr)
    return "done"


def test_prints_are_whole_lines_prefixed_by_rank_and_nothing_reaches_stderr(capfd):
    assert launch(chatty, 4, 50) == ["done"] * 4
    out, err = capfd.readouterr()
    assert err == ""  # nbgrader scores a test cell 0 if it writes to stderr
    lines = out.splitlines()
    assert len(lines) == 4 * 100
    for line in lines:
        rank = line[6]
        assert line.startswith(f"[rank {rank}] "), line[:40]
        body = line[9:]
        assert body == "to stderr" or body.split()[0] == rank * 300, line[:40]


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "2", None])
def test_world_size_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        launch(rank_info, bad, 0)


def test_refuses_when_a_default_group_is_already_initialised(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        with pytest.raises(RuntimeError, match="already initialised"):
            launch(rank_info, 2, 0)
    finally:
        dist.destroy_process_group()


def test_backend_is_gloo_on_cpu_and_nccl_is_refused_without_gpus(monkeypatch):
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has GPUs: the NCCL path is checked by tests/library/test_runtime_gpu.py")
    assert resolve_backend(2) == "gloo"
    monkeypatch.setenv("DPCOURSE_BACKEND", "nccl")
    with pytest.raises(ValueError, match="NCCL backend needs one GPU per rank"):
        launch(rank_info, 2, 0)


def test_the_spawn_path_runs_a_main_module_function_shipped_by_value(tmp_path):
    """The GPU path never forks: exercise it on the CPU with a function defined in __main__."""
    script = tmp_path / "main.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        from dpcourse import launch
        def double_sum(x):
            t = torch.tensor([x * (dist.get_rank() + 1)])
            dist.all_reduce(t)
            return t.item()
        print(launch(double_sum, 2, 2.0))
    """))
    env = dict(os.environ, DPCOURSE_START_METHOD="spawn")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[6.0, 6.0]"


def test_the_spawn_path_names_the_culprit_too(monkeypatch):
    monkeypatch.setenv("DPCOURSE_START_METHOD", "spawn")
    with pytest.raises(LaunchError) as info:
        launch(raises_on_rank_one, 2)
    assert info.value.rank == 1


PARENT = """
import os, sys, time
import torch.distributed as dist
from dpcourse import launch

def park(pid_dir, blocked):
    open(os.path.join(pid_dir, str(os.getpid())), "w").close()
    if blocked and dist.get_rank() == 0:
        import torch
        dist.recv(torch.zeros(1), src=1)  # blocked in gloo
    while True:
        pass  # spinning in Python

launch(park, 3, sys.argv[1], sys.argv[2] == "blocked", deadline=600, group_timeout=600)
"""


@pytest.mark.parametrize("how", ["spinning", "blocked"])
def test_ranks_die_with_their_parent(tmp_path, how):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    # start_new_session: the parent is a background job that ignores SIGINT, the case
    # where torch's own SIGINT death signal left ranks orphaned
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(pid_dir), how],
                              start_new_session=True, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, preexec_fn=lambda: signal.signal(
                                  signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.monotonic() + 60
        while len(os.listdir(pid_dir)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        ranks = [int(p) for p in os.listdir(pid_dir)]
        assert len(ranks) == 3 and all(is_running(p) for p in ranks)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 5
    while any(is_running(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in ranks if is_running(p)], "ranks outlived their parent"


def test_two_launches_at_once_do_not_collide(tmp_path):
    script = textwrap.dedent("""
        import torch, torch.distributed as dist
        from dpcourse import launch
        def total(tag):
            t = torch.tensor([float(tag + dist.get_rank())])
            dist.all_reduce(t)
            return t.item()
        for i in range(10):
            assert launch(total, 2, i) == [2.0 * i + 1] * 2
        print("ok")
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO) for _ in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0 and out.strip() == "ok", err


def not_written():
    raise NotImplementedError()


def broken():
    raise KeyError("a real bug")


def test_unless_not_written_names_unwritten_exercises_and_lets_real_bugs_through(capsys, no_orphans):
    from dpcourse.runtime.failures import unless_not_written

    with unless_not_written("my_slice"):
        not_written()
    with unless_not_written("gpipe_step", "run_schedule"):
        launch(not_written, 2)
    assert capsys.readouterr().out.splitlines()[-2:] == ["my_slice is not written yet",
                                                         "gpipe_step or run_schedule are not written yet"]
    with pytest.raises(LaunchError, match="a real bug"), unless_not_written("my_slice"):
        launch(broken, 2)


def test_a_rank_traceback_names_files_as_the_learner_knows_them():
    """Frames of torch and of the course by their package's names, not the machine's absolute paths; the
    grader's own plumbing and torch's decorators left out; the learner's cells as they are."""
    from dpcourse.runtime import failures

    text = ('Traceback (most recent call last):\n'
            '  File "/opt/x/.venv/lib/python3.11/site-packages/torch/_compile.py", line 54, in inner\n'
            '    return disable_fn(*args, **kwargs)\n'
            '  File "<cell 3>", line 36, in _gather\n'
            '    dist.all_gather(pieces, shard, group=self.group)\n'
            '  File "/opt/x/.venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", '
            'line 4280, in all_gather\n'
            '    work = group.allgather([tensor_list], [tensor], opts)\n'
            '  File "/home/me/course/dpcourse/grading/routed.py", line 327, in allgather\n'
            '    check_tensor_lists(...)\n'
            '  File "/home/me/course/dpcourse/comm/recorder.py", line 230, in check_tensor_lists\n'
            '    raise TensorLayoutError(\n'
            'TensorLayoutError: all_gather on a group of 2 ranks')
    lines = failures._trim_traceback(text)
    assert lines == ['  File "<cell 3>", line 36, in _gather',
                     '    dist.all_gather(pieces, shard, group=self.group)',
                     '  File "torch/distributed/distributed_c10d.py", line 4280, in all_gather',
                     '    work = group.allgather([tensor_list], [tensor], opts)',
                     '  File "dpcourse/comm/recorder.py", line 230, in check_tensor_lists',
                     '    raise TensorLayoutError(',
                     'TensorLayoutError: all_gather on a group of 2 ranks'], lines
