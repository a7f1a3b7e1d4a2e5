"""`make autograde`: a class of submissions into the gradebook, feedback without hidden tests, CSV."""

import csv
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from conftest import REPO
from grading import released_path, solution_path


def test_autograde_grades_the_class_exports_csv_and_feedback_hides_hidden_tests(tmp_path):
    (tmp_path / "solutions").symlink_to(REPO / "solutions")
    for student, source in (("alice", solution_path("00_orientation")),
                            ("bob", released_path("00_orientation"))):
        folder = tmp_path / "autograder" / "submitted" / student / "00_orientation"
        folder.mkdir(parents=True)
        shutil.copy(source, folder)
    env = dict(os.environ, DPCOURSE_COURSE_ROOT=str(tmp_path),
               DPCOURSE_DB_URL=f"sqlite:///{tmp_path / 'gradebook.db'}", DPCOURSE_DEADLINE="20")
    proc = subprocess.run([sys.executable, str(REPO / "autograder" / "autograde.py")], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]

    with open(tmp_path / "autograder" / "grades.csv") as f:
        rows = {row["student_id"]: row for row in csv.DictReader(f)}
    assert float(rows["alice"]["score"]) == 6.0 and float(rows["alice"]["max_score"]) == 6.0
    assert float(rows["bob"]["score"]) == 0.0

    for student in ("alice", "bob"):
        html = (tmp_path / "autograder" / "feedback" / student / "00_orientation" /
                "00_orientation.html").read_text()
        assert "test_my_slice_basic" in html or "my_slice" in html
        for secret in ("BEGIN HIDDEN TESTS", "dpgrader", "check_my_slice", "check_global_mean"):
            assert secret not in html, f"{student}'s feedback reveals {secret!r}"


def test_nbgrader_autograde_run_by_hand_judges_each_notebook_itself(tmp_path):
    """What the formgrader's Autograde button runs: `nbgrader autograde` with the course's config and
    no verdicts judged beforehand, so JudgedExecute starts the judge for each notebook."""
    (tmp_path / "solutions").symlink_to(REPO / "solutions")
    submitted = {"carol": solution_path("00_orientation"), "dan": released_path("00_orientation")}
    for student, source in submitted.items():
        folder = tmp_path / "autograder" / "submitted" / student / "00_orientation"
        folder.mkdir(parents=True)
        shutil.copy(source, folder)
    db = f"sqlite:///{tmp_path / 'gradebook.db'}"
    env = dict(os.environ, DPCOURSE_COURSE_ROOT=str(tmp_path), DPCOURSE_DB_URL=db, DPCOURSE_DEADLINE="20")
    env.pop("DPCOURSE_VERDICTS_DIR", None)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    for step in ("generate_assignment", "autograde"):
        proc = subprocess.run([sys.executable, "-m", "nbgrader", step, "00_orientation", "--force"],
                              cwd=REPO / "autograder", env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    from nbgrader.api import Gradebook

    with Gradebook(db) as gb:
        scores = {s: gb.find_submission("00_orientation", s).score for s in ("carol", "dan")}
    assert scores == {"carol": 6.0, "dan": 0.0}, scores


def test_make_autograde_works_from_a_clean_environment(no_orphans):
    """The README's instructor command, exactly: `make autograde` in a checkout with two submissions,
    from `env -i` with only PATH and HOME (no DPCOURSE_DB_URL, no course root): both graded, grades.csv
    and feedback written, exit status 0."""
    root = Path(tempfile.mkdtemp(prefix="dpcourse-make-", dir="/var/tmp"))  # not /tmp: sandboxes hide it
    try:
        for name in ("Makefile", "pyproject.toml", "requirements.txt"):
            shutil.copy2(REPO / name, root / name)
        (root / ".venv").symlink_to(REPO / ".venv")
        shutil.copytree(REPO / "course", root / "course", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copytree(REPO / "solutions" / "00_orientation", root / "solutions" / "00_orientation")
        shutil.copytree(REPO / "autograder", root / "autograder", ignore=shutil.ignore_patterns(
            "submitted", "autograded", "feedback", "gradebook.db", "grades.csv", ".judged", ".jupyter",
            "__pycache__"))
        for student, source in (("alice", solution_path("00_orientation")),
                                ("bob", released_path("00_orientation"))):
            folder = root / "autograder" / "submitted" / student / "00_orientation"
            folder.mkdir(parents=True)
            shutil.copy(source, folder)
        home = root / "home"
        home.mkdir()
        proc = subprocess.run(["env", "-i", "PATH=/usr/local/bin:/usr/bin:/bin", f"HOME={home}", "make", "-C",
                               str(root), "autograde"], capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        with open(root / "autograder" / "grades.csv") as f:
            scores = {row["student_id"]: float(row["score"]) for row in csv.DictReader(f)}
        assert scores == {"alice": 6.0, "bob": 0.0}, scores
        feedback = root / "autograder" / "feedback"
        for student in ("alice", "bob"):
            assert (feedback / student / "00_orientation" / "00_orientation.html").exists()
        assert (root / "autograder" / "gradebook.db").exists()  # nbgrader_config.py's default gradebook
    finally:
        shutil.rmtree(root, ignore_errors=True)


class FakeWorker:
    """A judge worker whose first judging of bob failed for want of threads (as if a neighbour held them)."""

    calls = []

    def __init__(self, sandboxed):
        self.restarts = 0

    def judge(self, source, submission, **_):
        FakeWorker.calls.append(Path(submission).parent.parent.name)
        cell = {"passed": True, "ename": None, "evalue": None, "output": "", "seconds": 0.1}
        if FakeWorker.calls.count("bob") == 1 and "bob" in str(submission):
            cell = dict(cell, passed=False, ename="LaunchError",
                        evalue="rank 0 of 4 raised RuntimeError: can't start new thread")
        return {"test_my_slice_basic": cell}

    def restart(self):
        self.restarts += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def test_a_submission_that_ran_short_of_resources_is_judged_again_and_named(tmp_path, monkeypatch):
    """A cell failing on "can't start new thread" (with the submission's own limits not reached) is not
    recorded as is: that submission is judged again by a fresh judge, and the run lists it with the
    submissions judged alongside (main() then exits 1)."""
    sys.path.insert(0, str(REPO / "autograder"))
    import autograde  # noqa: I001 - found through the path just added
    from dpgrader.judge import process

    monkeypatch.setattr(process, "JudgeWorker", FakeWorker)
    FakeWorker.calls = []
    subs = []
    for student in ("alice", "bob"):
        folder = tmp_path / "submitted" / student / "00_orientation"
        folder.mkdir(parents=True)
        subs.append((student, "00_orientation", Path(shutil.copy(solution_path("00_orientation"), folder))))
    run = autograde.ClassRun(subs, REPO, tmp_path / "verdicts", 1, True)
    run._work()
    assert FakeWorker.calls == ["alice", "bob", "bob"], FakeWorker.calls
    assert list(run.rejudged) == [("bob", "00_orientation")], run.rejudged
    assert "can't start new thread" in run.rejudged[("bob", "00_orientation")]["first"][0]
    assert not run.results[("bob", "00_orientation")].get("error")
    failed = {"passed": False, "ename": "RuntimeError", "evalue": "can't start new thread"}
    own_limits = {"test_my_slice_basic": failed, "_limits_reached": {"processes": 3}}
    assert autograde.starved(own_limits) == []  # its own processes hit its own cgroup's limit: its failure
    assert autograde.budget_for(10.0)[0] == 120.0 and autograde.budget_for(100.0)[0] == 300.0
