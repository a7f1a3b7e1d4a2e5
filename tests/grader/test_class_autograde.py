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
    from `env -i` with HOME only (no PATH at all, no DPCOURSE_DB_URL, no course root): both graded
    (bubblewrap found where the system keeps it), grades.csv and feedback written, exit status 0, and
    2 submissions at a time (autograde.py's default: the Makefile's JOBS is pytest's unless given)."""
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
        make = shutil.which("make")
        proc = subprocess.run(["env", "-i", f"HOME={home}", make, "-C", str(root), "autograde"],
                              capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "2 submission(s), 2 at a time" in proc.stdout, proc.stdout[-3000:]
        assert not proc.stderr.strip(), proc.stderr[-3000:]
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
    """A judge worker whose first judging of bob saw the machine run short (a sign from outside the learner's
    code: the judge's "_starved"), and whose carol raised "can't start new thread" herself."""

    calls = []

    def __init__(self, sandboxed):
        self.restarts = 0

    def judge(self, source, submission, **_):
        FakeWorker.calls.append(Path(submission).parent.parent.name)
        cell = {"passed": True, "ename": None, "evalue": None, "output": "", "seconds": 0.1}
        verdicts = {"test_my_slice_basic": cell}
        if FakeWorker.calls.count("bob") == 1 and "bob" in str(submission):
            verdicts["test_my_slice_basic"] = dict(cell, passed=False, ename="RuntimeError",
                                                   evalue="rank 0 could not be started (the kernel refused "
                                                          "to fork it: Resource temporarily unavailable)")
            verdicts["_starved"] = ["rank 0 could not be started (the kernel refused to fork it: Resource "
                                    "temporarily unavailable) while the notebook was within its own limits"]
        if "carol" in str(submission):  # her own text: not a sign of anything but her own failure
            verdicts["test_my_slice_basic"] = dict(cell, passed=False, ename="LaunchError",
                                                   evalue="rank 0 of 4 raised RuntimeError: can't start new "
                                                          "thread")
        return verdicts

    def restart(self):
        self.restarts += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def test_only_signs_from_outside_the_learners_code_get_a_submission_judged_again(tmp_path, monkeypatch):
    """bob's first judging saw the machine run short (the judge's "_starved": a fork of one of his ranks
    refused while he was within his limits): bob is judged again by a fresh judge, and the run lists him
    with the submissions judged alongside (main() then exits 1). carol's cell failed with "can't start new
    thread" in its own text: that is her failure, judged once, nobody named."""
    sys.path.insert(0, str(REPO / "autograder"))
    import autograde  # noqa: I001 - found through the path just added
    from dpgrader.judge import process

    monkeypatch.setattr(process, "JudgeWorker", FakeWorker)
    FakeWorker.calls = []
    subs = []
    for student in ("alice", "bob", "carol"):
        folder = tmp_path / "submitted" / student / "00_orientation"
        folder.mkdir(parents=True)
        subs.append((student, "00_orientation", Path(shutil.copy(solution_path("00_orientation"), folder))))
    run = autograde.ClassRun(subs, REPO, tmp_path / "verdicts", 1, True)
    run._work()
    assert FakeWorker.calls == ["alice", "bob", "bob", "carol"], FakeWorker.calls
    assert list(run.rejudged) == [("bob", "00_orientation")], run.rejudged
    assert "within its own limits" in run.rejudged[("bob", "00_orientation")]["first"][0]
    assert not run.results[("bob", "00_orientation")].get("error")
    assert not run.results[("carol", "00_orientation")].get("error")
    own_text = {"test_my_slice_basic": {"passed": False, "ename": "RuntimeError",
                                        "evalue": "can't start new thread"}}
    assert autograde.starved(own_text) == []  # what a cell says is never a sign
    assert autograde.starved(dict(own_text, _limits_reached={"processes": 3})) == []
    assert autograde.budget_for(10.0)[0] == 120.0 and autograde.budget_for(100.0)[0] == 300.0


class FakeCgroup:
    enforced = {"pids", "memory"}

    def __init__(self, reached):
        self.reached = reached

    def limits_reached(self):
        return self.reached


def test_a_refused_fork_is_the_notebooks_own_failure_when_its_limits_were_reached():
    """What the judge makes of the kernel refusing to fork a rank (the zygote reports it, ForkRefused):
    the notebook's own failure where its cgroup reached its limits or where there is no cgroup to tell
    (grading without root); else a sign that the machine ran short (RankPool.starved)."""
    from types import SimpleNamespace

    from dpgrader.judge.ranks import RankPool
    from dpgrader.judge.zygotes import ForkRefused

    pool = RankPool.__new__(RankPool)
    for reached, starved in (({"processes": 4, "memory": 0}, False), ({"processes": 0, "memory": 0}, True)):
        pool.starved, pool.submission = [], SimpleNamespace(cgroup=FakeCgroup(reached))
        error = pool.fork_refused(2, ForkRefused(11))
        assert "rank 2 could not be started" in str(error), error
        assert "Resource temporarily unavailable" in str(error), error
        assert bool(pool.starved) == starved, (reached, pool.starved, error)
        assert ("reached their limits" in str(error)) == (not starved), error
    pool.starved, pool.submission = [], None  # without root: no cgroup to tell, its own
    assert "too many processes" in str(pool.fork_refused(0, ForkRefused(11))) and not pool.starved
