"""From solutions/ to course/ with nbgrader: no drift, no leak, solutions validate, bad input explained."""

import filecmp
import json
import os
import re
import subprocess
import sys

import nbformat
import pytest

from conftest import REPO
from grading import ASSIGNMENTS, grade, released_path, solution_path
from markers import assignment_param

NBGRADER = [sys.executable, "-m", "nbgrader"]


def run_nbgrader(args, root):
    env = dict(os.environ, DPCOURSE_COURSE_ROOT=str(root),
               DPCOURSE_DB_URL=f"sqlite:///{root / 'gradebook.db'}")
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env["PATH"]])
    return subprocess.run([*NBGRADER, *args], cwd=REPO / "autograder", env=env, capture_output=True,
                          text=True, timeout=600)


def test_course_is_exactly_what_nbgrader_generates_from_solutions(tmp_path):
    (tmp_path / "solutions").symlink_to(REPO / "solutions")
    for assignment in ASSIGNMENTS:
        proc = run_nbgrader(["generate_assignment", assignment, "--force"], tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
        fresh, committed = tmp_path / "course" / assignment, REPO / "course" / assignment
        diff = filecmp.dircmp(fresh, committed, ignore=["__pycache__", ".ipynb_checkpoints"])
        assert not (diff.left_only or diff.right_only or diff.diff_files), (
            f"course/{assignment} drifted from solutions/ (run `make assignments`): only generated "
            f"{diff.left_only}, only committed {diff.right_only}, different {diff.diff_files}")


def solution_and_hidden_lines(path):
    """Substantial lines between BEGIN/END SOLUTION or HIDDEN TESTS markers, except those the notebook also
    shows outside them (a demo may call `dcp.save(...)` as the solution does: that line is public anyway)."""
    secret, public, inside = [], [], False
    for cell in nbformat.read(path, as_version=4).cells:
        for line in cell.source.splitlines():
            if re.search(r"### BEGIN (SOLUTION|HIDDEN TESTS)", line):
                inside = True
            elif re.search(r"### END (SOLUTION|HIDDEN TESTS)", line):
                inside = False
            elif inside and len(line.strip()) > 12:
                secret.append(line.strip())
            elif not inside:
                public.append(line)
    shown = "\n".join(public)
    return [line for line in secret if line not in shown]


@pytest.mark.parametrize("assignment", [assignment_param(a) for a in ASSIGNMENTS])
def test_course_holds_no_solution_code_and_no_hidden_test(assignment):
    released = released_path(assignment).read_text()
    assert "BEGIN SOLUTION" not in released and "HIDDEN TESTS" not in released
    assert "dpgrader" not in released
    secret = solution_and_hidden_lines(solution_path(assignment))
    assert secret, "the solution notebook has no solution or hidden test lines"
    leaked = [line for line in secret if json.dumps(line)[1:-1] in released]
    assert not leaked, f"solution or hidden lines reached course/: {leaked}"
    for path in (REPO / "course" / assignment).rglob("*"):
        if path.is_file() and path.suffix != ".ipynb":
            text = path.read_text(errors="ignore")
            assert "BEGIN SOLUTION" not in text and "dpgrader" not in text, path


@pytest.mark.parametrize("assignment", [assignment_param(a) for a in ASSIGNMENTS])
def test_each_solution_passes_nbgrader_validate(assignment):
    proc = subprocess.run([*NBGRADER, "validate", str(solution_path(assignment))],
                          cwd=REPO / "autograder", capture_output=True, text=True, timeout=900)
    assert "Success! Your notebook passes all the tests." in proc.stdout, proc.stdout[-3000:]


def test_released_notebook_fails_nbgrader_validate():
    proc = subprocess.run([*NBGRADER, "validate", str(released_path("00_orientation"))],
                          cwd=REPO / "autograder", capture_output=True, text=True, timeout=900)
    assert "NotImplementedError" in proc.stdout and "Success!" not in proc.stdout


def test_exercise_index_and_readme_table_are_fresh():
    proc = subprocess.run([sys.executable, str(REPO / "autograder" / "exercises.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
    index = json.loads((REPO / "autograder" / "exercises.json").read_text())
    first = next(e for e in index if e["solution"] == "my_slice")
    assert {k: v for k, v in first.items() if k not in ("planted_bugs", "reference")} == {
        "assignment": "00_orientation", "notebook": "solutions/00_orientation/00_orientation.ipynb",
        "kind": "code", "solution": "my_slice", "tests": ["test_my_slice_basic", "test_my_slice_edge_cases"],
        "points": 3.0, "function": "my_slice", "signature": "my_slice(data)",
        "grader": "autograder/dpgrader/orientation/",
        "hidden_checks": ["dpgrader.orientation.checks.check_my_slice"], "tuned": None,
        "expected_grades": "autograder/dpgrader/orientation/expected_grades.json",
        "helpers": ["dpcourse.checks.ranks", "dpcourse.runtime.launcher"],
        "demos": ["dpcourse.runtime.launcher", "dpcourse.viz.colours"]}
    assert first["reference"], first


def test_grade_explains_a_file_that_is_not_a_notebook(tmp_path):
    broken = tmp_path / "00_orientation.ipynb"
    broken.write_text('{"cells": [')
    unknown = tmp_path / "my_homework.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), unknown)
    first, second = grade([broken, unknown])
    assert "is not a readable notebook" in first["error"] and first["score"] == 0
    assert "no assignment has a notebook named 'my_homework.ipynb'" in second["error"]


def test_grade_explains_a_notebook_with_deleted_cells(tmp_path):
    nb = nbformat.read(released_path("00_orientation"), as_version=4)
    nb.cells = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") != "my_slice"]
    path = tmp_path / "00_orientation.ipynb"
    nbformat.write(nb, path)
    (result,) = grade([path])
    assert result["score"] == 0
    assert "my_slice" in result.get("error", "") or any(
        "my_slice" in c["message"] for c in result["cells"]), result


def test_grading_refuses_without_the_sandbox_and_says_how_to_get_it(tmp_path):
    """No bubblewrap on PATH: grade.py refuses (exit 2) and names the fix; it never grades unsandboxed
    unless asked (--no-sandbox, whose report says so)."""
    env = dict(os.environ, PATH=str(tmp_path))  # no bwrap here; python is called by its full path
    proc = subprocess.run([sys.executable, str(REPO / "autograder" / "grade.py"),
                           str(released_path("00_orientation"))], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "grading refused" in proc.stderr and "make sandbox-deps" in proc.stderr, proc.stderr
    assert "--no-sandbox" in proc.stderr


def test_grading_refuses_a_course_under_tmp_and_says_where_to_put_it(tmp_path):
    """Every graded rank gets a private /tmp: a course cloned under /tmp would vanish from under its ranks,
    so grading refuses it up front with a message (not a ModuleNotFoundError in rank 0)."""
    probe = ("import sys, pathlib; sys.path.insert(0, 'autograder');"
             "from dpgrader.judge import sandbox; sandbox.COURSE = pathlib.Path('/tmp/clone/course');"
             "sandbox.require()")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and "lives under /tmp (/tmp/clone/course)" in proc.stderr, proc.stderr
    assert "clone the course elsewhere" in proc.stderr, proc.stderr
