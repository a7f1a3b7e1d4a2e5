"""The judge as grade.py and autograde.py drive it (autograder/dpgrader/judge/process.py).

A judge worker judges submissions one after another with the same sandboxes; a submission that
breaks or stalls its judge must cost only its own grade, name why, and leave the worker able to
judge the next one. The judge also sees read-only cells as the instructor wrote them, as
nbgrader's autograde restores them.
"""

import json
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
    monkeypatch.setenv("DPCOURSE_SANDBOX_SHARED", shared)
    with JudgeWorker(sandboxed=True) as worker:
        pids = []
        for owner in ("alice", "alice", "bob"):
            assert set(passed(worker.judge(SOURCE, SOURCE, owner=owner)).values()) == {True}
            pids.append(worker.proc.pid)
    assert pids[0] == pids[1]
    assert (pids[2] == pids[1]) == (shared == "1"), pids
