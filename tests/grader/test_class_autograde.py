"""`make autograde`: a class of submissions into the gradebook, feedback without hidden tests, CSV."""

import csv
import os
import shutil
import subprocess
import sys
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
