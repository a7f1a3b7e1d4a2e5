"""An instructor in the browser: the Formgrader panel of `make formgrader`, after `make autograde`
graded a few generated submissions; then the class report of `make report` (autograder/class_report.py),
its causes counted right, opened in the same JupyterLab."""

import csv
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbgrader.api import Gradebook

from grading import variants_of

from .conftest import REPO, WAIT
from .steps import appear, click, exactly, hide_left_sidebar, menu, open_lab, open_path, until

ASSIGNMENT = "00_orientation"
NOTEBOOK = f"{ASSIGNMENT}/{ASSIGNMENT}.ipynb"
ASSIGNMENTS = sorted(p.name for p in (REPO / "solutions").glob("[0-9]*") if p.is_dir())


SOLUTION, RELEASED = REPO / "solutions" / NOTEBOOK, REPO / "course" / NOTEBOOK
# Four learners: everything right, nothing written yet, and two with the same planted bug (a mean of
# means), which the class report must count as one cause of two students.
SUBMISSIONS = {
    "ada": (SOLUTION, {}),
    "bob": (RELEASED, {}),
    "cyd": (SOLUTION, variants_of(ASSIGNMENT)["mean_of_means"]["cells"]),
    "dan": (SOLUTION, variants_of(ASSIGNMENT)["mean_of_means"]["cells"]),
}
NAMES = {"ada": ("Ada", "Lovelace"), "bob": ("Bob", "Barker"), "cyd": ("Cyd", "Charisse"),
         "dan": ("Dan", "Dare")}


def notebook_with(path, cells):
    """The notebook at `path` with the cells named in `cells` (grade_id -> source) replaced."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        cell.source = cells.get(cell.metadata.get("nbgrader", {}).get("grade_id"), cell.source)
    return nb


@pytest.fixture
def graded_course(tmp_path, shots, monkeypatch):
    """A scratch course root (DPCOURSE_COURSE_ROOT, its own gradebook) with submissions of notebook 00,
    graded by `make autograde`; returns the environment that points nbgrader at it, and the grades."""
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")  # alembic
    root = tmp_path / "course-root"
    shutil.copytree(REPO / "solutions", root / "solutions")
    for student, (base, cells) in SUBMISSIONS.items():
        path = root / "autograder" / "submitted" / student / NOTEBOOK
        path.parent.mkdir(parents=True)
        nbformat.write(notebook_with(base, cells), path)
    env = {"DPCOURSE_COURSE_ROOT": str(root),
           "DPCOURSE_DB_URL": f"sqlite:///{root / 'autograder' / 'gradebook.db'}"}
    with Gradebook(env["DPCOURSE_DB_URL"]) as gradebook:  # the class list (`nbgrader db student add`)
        for student, (first, last) in NAMES.items():
            gradebook.add_student(student, first_name=first, last_name=last)
    log = shots.folder / "autograde.log"
    with open(log, "w") as out:
        process = subprocess.Popen(["make", "-s", "autograde"], cwd=REPO, env={**os.environ, **env},
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            process.wait(timeout=WAIT["autograde"])
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            pytest.fail(f"`make autograde` did not finish within {WAIT['autograde']} s (log: {log})")
    assert process.returncode == 0, f"`make autograde` failed:\n{log.read_text()[-3000:]}"
    with open(root / "autograder" / "grades.csv") as f:
        grades = {row["student_id"]: row for row in csv.DictReader(f)}
    return env, grades


def points(value):
    """A score as the formgrader prints it (at most 2 decimals, no trailing zeros)."""
    return f"{round(float(value), 2):g}"


def test_formgrader_lists_the_assignments_and_shows_the_scores(start_server, page, shots, graded_course):
    env, grades = graded_course
    assert set(grades) == set(SUBMISSIONS), f"grades.csv has {sorted(grades)}"
    assert float(grades["ada"]["score"]) == float(grades["ada"]["max_score"]) > 0
    assert float(grades["bob"]["score"]) == 0
    for student in ("cyd", "dan"):
        assert 0 < float(grades[student]["score"]) < float(grades[student]["max_score"])

    server = start_server("formgrader", env=env)
    open_lab(page, server)
    hide_left_sidebar(page)
    menu(page, "Nbgrader", "Formgrader")
    formgrader = page.frame_locator("#formgrader-iframe iframe")
    for name in ASSIGNMENTS:
        appear(formgrader.locator("#main-table td.name", has_text=exactly(name)),
               f"the assignment {name} in the Formgrader's list", "lab")
    formgrader.locator("#main-table").evaluate("table => table.scrollIntoView()")
    shots(page, "formgrader-assignments")

    row = formgrader.locator("#main-table tr",
                             has=formgrader.locator("td.name", has_text=exactly(ASSIGNMENT)))
    click(row.locator("td.num-submissions a"), f"the link to the submissions of {ASSIGNMENT}")
    students = formgrader.locator("#main-table tr", has=formgrader.locator("td.student-id"))
    appear(students, f"the submissions of {ASSIGNMENT}", "lab")

    def scores():
        shown = {r.locator("td.student-id").inner_text(): r.locator("td.score").inner_text()
                 for r in students.all()}
        return shown if len(shown) == len(SUBMISSIONS) and all(shown.values()) else None

    shown = until(page, scores, f"the scores of the {len(SUBMISSIONS)} submissions did not all appear", "lab")
    formgrader.locator(".breadcrumb").evaluate("crumbs => crumbs.scrollIntoView()")
    shots(page.locator("#formgrader-iframe"), "formgrader")
    expected = {s: f"{points(g['score'])} / {points(g['max_score'])}" for s, g in grades.items()}
    assert shown == expected, f"the Formgrader shows {shown}; the gradebook says {expected}"

    check_class_report(page, shots, env)


def check_class_report(page, shots, env):
    """`make report` on the graded class: each exercise's causes of failure with the students they
    stopped (the planted mean of means: cyd and dan; nothing written: bob), where each student stopped;
    then the page itself, opened from the file browser of the same JupyterLab."""
    made = subprocess.run(["make", "-s", "report"], cwd=REPO, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=WAIT["lab"])
    assert made.returncode == 0, made.stdout + made.stderr
    sys.path.insert(0, str(REPO / "autograder"))
    import class_report  # noqa: I001 - found through the path just added

    data = class_report.gather(Path(env["DPCOURSE_COURSE_ROOT"]))
    causes = {(key, cause): sorted(data["students_with"][("00_orientation", key, cause)])
              for (assignment, key), counted in data["failures"].items() for cause in counted}
    mean_of_means = [who for (key, cause), who in causes.items()
                     if key == "global_mean" and "global_mean of unequal shards is" in cause]
    assert mean_of_means == [["cyd", "dan"]], causes
    assert data["failures"][("00_orientation", "global_mean")].most_common(1)[0][1] == 2, causes
    not_written = {key: who for (key, cause), who in causes.items() if "not written yet" in cause}
    assert not_written == {"my_slice": ["bob"], "global_mean": ["bob"]}, causes
    assert data["judged"] == len(SUBMISSIONS) and not data["not_graded"], data["not_graded"]
    stopped = {s: (w["where"], w["why"]) for s, w in data["stopped"].items()}
    assert stopped["ada"][0] is None and stopped["bob"][0] == f"{ASSIGNMENT} / my_slice", stopped
    assert stopped["cyd"][0] == stopped["dan"][0] == f"{ASSIGNMENT} / global_mean", stopped

    html = (Path(env["DPCOURSE_COURSE_ROOT"]) / "autograder" / "class_report.html").read_text()
    assert "global_mean of unequal shards is" in html and "not written yet" in html
    page.locator(".jp-SideBar.jp-mod-left .lm-TabBar-tab[data-id='filebrowser']").click()
    open_path(page, "autograder/class_report.html")
    frame = page.frame_locator(".jp-HTMLViewer:visible iframe")
    appear(frame.locator("h1", has_text="Class report"), "the class report in JupyterLab's HTML viewer",
           "lab")
    shots(page.locator(".jp-HTMLViewer:visible"), "class-report")
