"""The judge as grade.py and autograde.py drive it (autograder/dpgrader/judge/process.py).

A judge worker judges submissions one after another with the same sandboxes; a submission that
breaks or stalls its judge must cost only its own grade, name why, and leave the worker able to
judge the next one. The judge also sees read-only cells as the instructor wrote them, as
nbgrader's autograde restores them.
"""

import json
import os
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import REPO
from dpgrader.judge.learner import program_cells, restore_locked
from dpgrader.judge.process import JudgeWorker

pytestmark = pytest.mark.slow
SOURCE = REPO / "solutions" / "00_orientation" / "00_orientation.ipynb"
RELEASED = REPO / "course" / "00_orientation" / "00_orientation.ipynb"


def passed(verdicts):
    return {grade_id: v["passed"] for grade_id, v in verdicts.items() if not grade_id.startswith("_")}


def test_a_judge_that_stalls_or_breaks_costs_only_that_submission(tmp_path, no_orphans):
    garbage = tmp_path / "garbage.ipynb"
    garbage.write_text(json.dumps({"cells": "not a list"}))
    with JudgeWorker(sandboxed=True) as worker:
        scratch = Path(worker.scratch)  # shared by the judge and its ranks
        stalled = worker.judge(SOURCE, SOURCE, timeout=0.5)
        solution = worker.judge(SOURCE, SOURCE)
        broken = worker.judge(SOURCE, garbage)
        released = worker.judge(SOURCE, RELEASED)
        again = worker.judge(SOURCE, SOURCE)
    assert "stopped after 0.5 s" in stalled["error"], stalled
    assert "exit status" in broken["error"] and "Traceback" in broken["error"], broken["error"][-500:]
    assert set(passed(solution).values()) == {True} and len(passed(solution)) == 4, solution
    assert set(passed(released).values()) == {False}, released
    assert passed(again) == passed(solution)
    assert not scratch.exists(), "the judges' scratch folder was left behind"


def cell(source, **nbgrader):
    metadata = {"nbgrader": nbgrader} if nbgrader else {}
    return SimpleNamespace(cell_type="code", source=source, metadata=metadata)


def test_edited_read_only_cells_are_restored_before_the_learner_program_runs():
    source = SimpleNamespace(cells=[
        cell("import torch", grade_id="setup", locked=True),
        cell("def f(): ...", grade_id="f", solution=True),
    ])
    submission = SimpleNamespace(cells=[
        cell("import torch\nimport builtins; builtins.len = None", grade_id="setup", locked=True),
        cell("def f(): return 1", grade_id="f", solution=True),
        cell("helper = 2"),
    ])
    assert program_cells(restore_locked(submission, source)) == ["import torch", "def f(): return 1",
                                                                 "helper = 2"]


@pytest.mark.parametrize("shared", ["1", "0"])
def test_a_judge_serves_one_learner_only_where_ranks_share_a_user_with_their_sandbox(shared, monkeypatch):
    """As root each rank runs as its own user, cut off from its sandbox's warm interpreter, so one
    judge may serve the whole class; without root (DPCOURSE_SANDBOX_SHARED=0 gives that layout)
    a new learner gets a fresh judge."""
    if shared == "1" and os.geteuid() != 0:
        pytest.skip("ranks run as users of their own only as root (without root: the [0] case)")
    monkeypatch.setenv("DPCOURSE_SANDBOX_SHARED", shared)
    with JudgeWorker(sandboxed=True) as worker:
        pids = []
        for owner in ("alice", "alice", "bob"):
            assert set(passed(worker.judge(SOURCE, SOURCE, owner=owner)).values()) == {True}
            pids.append(worker.proc.pid)
    assert pids[0] == pids[1]
    assert (pids[2] == pids[1]) == (shared == "1"), pids


# ---------------------------------------------------------------------------------------------------
# One learner cannot touch another's grade (the grader-trust issue, second review): every submission
# is judged in a pid namespace, cgroup and user ids of its own, killed when it is judged.

def submission(tmp_path, name, assignment, cells, base="solutions"):
    """`base`'s notebook of `assignment` with solution cells replaced (grade_id -> source)."""
    import nbformat

    path = next((REPO / base / assignment).glob("*.ipynb"))
    nb = nbformat.read(path, as_version=4)
    for c in nb.cells:
        if c.metadata.get("nbgrader", {}).get("grade_id") in cells:
            c.source = cells[c.metadata["nbgrader"]["grade_id"]]
    target = tmp_path / name / path.name
    target.parent.mkdir(parents=True)
    nbformat.write(nb, target)
    return target


FIRST_PRINCIPLES = REPO / "solutions" / "01_first_principles" / "01_first_principles.ipynb"
DAEMON_FROM_A_CALL = '''
import os, signal, time
def shard_indices(n, rank, world_size, remainder="spread"):
    """Called directly by the test cells: leaves a daemon that kills every process it may signal."""
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            while True:
                try:
                    os.kill(-1, signal.SIGKILL)
                except OSError:
                    pass
                time.sleep(0.05)
        os._exit(0)
    time.sleep(0.2)
    return list(range(n))[rank::world_size]
'''


def test_a_daemon_left_by_a_direct_call_does_not_reach_the_next_learner(tmp_path, no_orphans):
    attacker = submission(tmp_path, "attacker", "01_first_principles", {"shard_indices": DAEMON_FROM_A_CALL})
    with JudgeWorker(sandboxed=True) as worker:
        worker.judge(FIRST_PRINCIPLES, attacker, owner="mallory")
        honest = worker.judge(FIRST_PRINCIPLES, FIRST_PRINCIPLES, owner="alice")
    assert passed(honest) and set(passed(honest).values()) == {True}, honest


HOG = '''
import os, threading, time
def my_slice(data):
    """Takes every process and thread it can get and holds them (only on 4 ranks: two launches)."""
    import torch.distributed as dist
    if dist.get_world_size() == 4:
        for _ in range(300):
            try:
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
            except OSError:
                break
        for _ in range(300):
            try:
                threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
            except RuntimeError:
                break
        time.sleep(10)
    return data[dist.get_rank()::dist.get_world_size()]
'''


def test_a_learner_holding_every_process_it_can_does_not_starve_its_neighbour(tmp_path, no_orphans):
    """Each submission's processes count against its own cgroup, not against a user id the whole machine
    shares: an honest learner judged at the same time keeps full marks."""
    import threading

    attacker = submission(tmp_path, "attacker", "00_orientation", {"my_slice": HOG})
    results = {}

    def judge_as(name, path, delay):
        time.sleep(delay)
        with JudgeWorker(sandboxed=True) as worker:
            results[name] = worker.judge(SOURCE, path, owner=name)

    threads = [threading.Thread(target=judge_as, args=("mallory", attacker, 0)),
               threading.Thread(target=judge_as, args=("alice", SOURCE, 4))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    assert set(passed(results["alice"]).values()) == {True} and len(passed(results["alice"])) == 4, results


FILL_AND_ANNOUNCE = '''
import json, struct, time
def my_slice(data):
    """Writes until the disk says no, then announces a 1 GiB message to the router and sends 1 MiB of it."""
    import torch.distributed as dist
    from dpcourse.grading import routed
    wrote = 0
    for folder in ("/tmp", "/var/tmp", "/dev/shm"):
        try:
            with open(f"{folder}/fill-{dist.get_rank()}", "wb") as f:
                for _ in range(4096):
                    f.write(b"x" * (1 << 20))
                    wrote += 1 << 20
        except OSError:
            pass
    print(f"wrote {wrote >> 20} MiB")
    head = json.dumps({"k": "send", "seq": 999, "group": list(range(dist.get_world_size())), "dst": 0,
                       "tag": 0, "tensors": [["uint8", [1 << 30], 1 << 30]]}).encode()
    routed._link.sock.sendall(struct.pack("<II", len(head), 1 << 30) + head + bytes(1 << 20))
    time.sleep(2)
    return data[dist.get_rank()::dist.get_world_size()]
'''


def peak_memory(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM:")).split()[1]) << 10


def test_disk_writes_are_bounded_and_a_1_gib_message_does_not_grow_the_judge(tmp_path, no_orphans):
    attacker = submission(tmp_path, "attacker", "00_orientation", {"my_slice": FILL_AND_ANNOUNCE})
    with JudgeWorker(sandboxed=True) as worker:
        worker.judge(SOURCE, SOURCE)
        before = peak_memory(worker.proc.pid)
        verdicts = worker.judge(SOURCE, attacker)
        grown = peak_memory(worker.proc.pid) - before
    wrote = [int(n) for n in re.findall(r"wrote (\d+) MiB", verdicts["test_my_slice_basic"]["output"])]
    assert wrote and max(wrote) <= 3 * 256 + 64, verdicts["test_my_slice_basic"]["output"][-500:]
    assert grown < 150 << 20, f"the judge grew by {grown >> 20} MiB"
    # the rank blocked writing the rest of its 1 GiB is told at once (not left to the launch's deadline)
    assert "did not finish within" not in verdicts["test_my_slice_basic"]["evalue"], verdicts


TOO_LARGE = '''
def my_slice(data):
    import torch, torch.distributed as dist
    dist.all_reduce(torch.zeros(10_000_000, dtype=torch.float64))  # 80 MB: no exercise of 00 needs that
    return data[dist.get_rank()::dist.get_world_size()]
'''


def test_a_message_larger_than_the_exercise_needs_is_refused_saying_so(tmp_path, no_orphans):
    """The router stops reading a rank whose frame is too large; the rank's call fails with the router's
    reason, not with the broken pipe that stopping leaves."""
    big = submission(tmp_path, "big", "00_orientation", {"my_slice": TOO_LARGE})
    with JudgeWorker(sandboxed=True) as worker:
        verdicts = worker.judge(SOURCE, big)
    message = verdicts["test_my_slice_basic"]["evalue"]
    assert "a message of 80000000 bytes" in message and "needs that much" in message, message
    assert passed(verdicts)["test_global_mean_basic"], verdicts


SLEEPER = "import time\ndef my_slice(data):\n    time.sleep(55)\n"


def test_a_slow_on_purpose_notebook_stops_at_its_time_budget(tmp_path, no_orphans):
    sleeper = submission(tmp_path, "sleeper", "00_orientation", {"my_slice": SLEEPER})
    with JudgeWorker(sandboxed=True) as worker:
        start = time.monotonic()
        verdicts = worker.judge(SOURCE, sleeper, budget=15, budget_why=": the test's")
        took = time.monotonic() - start
    assert took < 60, f"{took:.0f} s"
    assert not any(passed(verdicts).values()), verdicts
    assert "time budget" in verdicts["test_global_mean_unequal_shards"]["evalue"], verdicts


LOOK_AROUND = '''
import os, sys
seen = {}
for what, path in PATHS.items():
    try:
        seen[what] = bool(open(path, "rb").read(1) if os.path.isfile(path) else os.listdir(path))
    except OSError:
        seen[what] = False
seen["secret in environment"] = any("planted" in v for v in os.environ.values())
home = set(os.listdir("/root")) if os.path.isdir("/root") else set()
seen["root's home (but the Python installation)"] = bool(home - {".pyenv"})
print(sorted(k for k, v in seen.items() if v))
'''


@pytest.mark.skipif(os.geteuid() != 0, reason="the judge has a sandbox of its own only as root (without "
                    "root it runs as the grading user, who may read what it reads; its ranks are sandboxed: "
                    "tests/grader/test_judge_ranks.py::test_a_rank_sees_only_the_course_and_the_environment)")
def test_the_judge_sees_only_what_it_needs(tmp_path, monkeypatch):
    """The judge process (root: it starts the ranks' sandboxes) runs in a sandbox of its own: an
    instructor's test cell run there finds no gradebook, no other submission, no solutions folder, no
    /etc/shadow and nothing of the caller's environment, but the hidden checks and the course."""
    import nbformat

    monkeypatch.setenv("DPCOURSE_PLANTED", "planted")
    planted = REPO.parent / f".dpcourse-test-look-{os.getpid()}"
    planted.write_text("planted")
    paths = {"solutions": str(REPO / "solutions"), "submitted": str(REPO / "autograder" / "submitted"),
             "nbgrader_config": str(REPO / "autograder" / "nbgrader_config.py"), "shadow": "/etc/shadow",
             "next to the checkout": str(planted), "this test": __file__,
             "hidden checks": str(REPO / "autograder" / "dpgrader" / "orientation" / "checks.py"),
             "course": str(REPO / "course" / "dpcourse" / "__init__.py")}
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(f"PATHS = {paths!r}\n" + LOOK_AROUND,
                                          metadata={"nbgrader": {"grade": True, "grade_id": "look",
                                                                 "points": 1, "locked": True}})]
    source = tmp_path / "look.ipynb"
    nbformat.write(nb, source)
    try:
        with JudgeWorker(sandboxed=True) as worker:
            verdicts = worker.judge(source, source)
    finally:
        planted.unlink()
    assert verdicts["look"]["passed"], verdicts
    seen = verdicts["look"]["output"]
    assert seen.strip() == str(["course", "hidden checks"]), seen


def test_a_kernels_start_never_removes_the_connection_folder_of_a_kernel_starting_beside_it(tmp_path,
                                                                                           monkeypatch):
    """Two kernels start at once (JOBS=2, DPCOURSE_RUN_KERNEL=1): one has made its folder (given to the
    user its kernel will run as, who has no process yet) when the other cleans up stale copies. Only a
    folder whose kernel's process (named in the folder) is gone is removed."""
    import subprocess
    import tempfile

    from dpgrader.judge import kernel

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    starting = tmp_path / f"dpcourse-kernel-{os.getpid()}-abc"  # a live process: a kernel starting now
    dead = subprocess.Popen(["true"])
    dead.wait()
    ended = tmp_path / f"dpcourse-kernel-{dead.pid}-def"
    mine = tmp_path / "dpcourse-kernel-1-keep"
    for folder in (starting, ended, mine):
        folder.mkdir()
        (folder / "connection.json").write_text("{}")
    if os.geteuid() == 0:
        os.chown(starting, 3999999, 3999999)  # a fresh user id with no process yet
    kernel._remove_stale_copies(keep=mine)
    assert starting.exists() and mine.exists() and not ended.exists()
