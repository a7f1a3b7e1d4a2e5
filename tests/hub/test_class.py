"""A class on JupyterHub (`make hub`), in Chromium.

The instructor releases notebook 00 from the Formgrader; student A fetches it from the Assignments tab,
writes my_slice, validates and submits; student B submits it unchanged. The instructor collects, grades
with `make autograde` in a terminal (the course's judge and sandbox, as ever), generates and releases the
feedback; A sees 3 / 6 with the hidden tests cleared, B sees 0. From the command line, as the class's
users: C submits twice (the latest counts) and once more after the due date (collected and graded
alone), D submits a file that is not a notebook (reported, the others graded), E never submits (0);
and no student may read the solutions, the hidden checks, the gradebook, another's home or submission.
"""

import csv
import math
import re
import subprocess
import threading
import time
from pathlib import Path

import nbformat
from browser.steps import replace_line, validate

from .conftest import INSTRUCTOR, REPO, STUDENTS
from .steps import (
    fetch,
    fetch_feedback,
    formgrader_action,
    lab_ready,
    log_in,
    open_assignments,
    open_feedback,
    open_fetched_notebook,
    open_formgrader,
    open_terminal,
    set_due_date,
    submissions_count,
    submit,
    type_in_terminal,
    until,
)

ASSIGNMENT = NOTEBOOK = "00_orientation"
STUB = "raise NotImplementedError()"
SECRETS = ("BEGIN HIDDEN TESTS", "dpgrader", "check_my_slice", "check_global_mean")  # never in feedback
A, B, C, D, E = (STUDENTS[k] for k in "abcde")


def solution_of(exercise):
    """The body of an exercise's solution (solutions/), without nbgrader's markers."""
    nb = nbformat.read(REPO / "solutions" / ASSIGNMENT / f"{NOTEBOOK}.ipynb", as_version=4)
    cell = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == exercise)
    return "\n".join(line for line in cell.source.splitlines() if "### BEGIN SOLUTION" not in line
                     and "### END SOLUTION" not in line)


def code_ids(path):
    """nbgrader's grade_id of each code cell of a notebook (None for an ordinary cell), in order."""
    cells = nbformat.read(path, as_version=4).cells
    return [c.metadata.get("nbgrader", {}).get("grade_id") for c in cells if c.cell_type == "code"]


def write_as(hub, user, path, text):
    """Write a file in a user's home as that user (the test stands in for their editor)."""
    proc = hub.run_as(user, "tee", str(path), input=text)
    assert proc.returncode == 0, proc.stderr


def solved(path):
    """The notebook at `path` with both exercises' solutions written in."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        exercise = cell.metadata.get("nbgrader", {}).get("grade_id")
        if exercise in ("my_slice", "global_mean"):
            cell.source = solution_of(exercise)
    return nbformat.writes(nb)


def nbgrader(hub, user, *args):
    """`nbgrader ARGS` as `user`, as their server would run it; fails the test if it fails."""
    proc = hub.run_as(user, "nbgrader", *args)
    assert proc.returncode == 0, f"nbgrader {' '.join(args)} as {user} failed:\n{proc.stdout}{proc.stderr}"
    return proc.stdout + proc.stderr


class InBackground(threading.Thread):
    """Steps run from the command line while the browser goes on; join() re-raises their failure."""

    def __init__(self, steps):
        super().__init__(daemon=True)
        self.steps, self.error = steps, None

    def run(self):
        try:
            self.steps()
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread by join()
            self.error = exc

    def join(self, timeout=None):
        super().join(timeout)
        assert not self.is_alive(), f"the command-line steps did not finish within {timeout} s"
        if self.error:
            raise self.error


def first_submissions_of_c_and_d(hub):
    """C submits the solution, then changes their mind and submits the released notebook (collect takes
    the latest: C scores 0); D submits a file that is not a notebook (without fetching: their own)."""
    work_c, work_d = (hub.home(s) / ASSIGNMENT / f"{NOTEBOOK}.ipynb" for s in (C, D))
    nbgrader(hub, C, "fetch_assignment", ASSIGNMENT)
    released = work_c.read_text()
    write_as(hub, C, work_c, solved(work_c))
    nbgrader(hub, C, "submit", ASSIGNMENT)
    write_as(hub, C, work_c, released)
    nbgrader(hub, C, "submit", ASSIGNMENT)
    hub.run_as(D, "mkdir", str(work_d.parent))
    write_as(hub, D, work_d, '{"cells": [ this is not a notebook')
    nbgrader(hub, D, "submit", ASSIGNMENT)


def late_submission_of_c(hub):
    work_c = hub.home(C) / ASSIGNMENT / f"{NOTEBOOK}.ipynb"
    write_as(hub, C, work_c, solved(work_c))
    nbgrader(hub, C, "submit", ASSIGNMENT)


def run_autograde(hub, page, terminal, shots, name, *make_args):
    """`make autograde` typed in the instructor's terminal, as the README says; returns its exit status and
    output, which the command also leaves in the instructor's home (read from there: a terminal draws
    its text on a canvas)."""
    log, status = hub.home(INSTRUCTOR) / f"{name}.log", hub.home(INSTRUCTOR) / f"{name}.status"
    type_in_terminal(page, terminal, f'make -C "$DPCOURSE_REPO" autograde {" ".join(make_args)} 2>&1 '
                                     f'| tee ~/{log.name}; echo ${{PIPESTATUS[0]}} > ~/{status.name}')
    until(page, lambda: status.exists() and status.read_text().strip(),
          f"`make autograde` ({name}) typed in the terminal did not finish", "autograde")
    shots(page, name)
    return int(status.read_text()), log.read_text()


def feedback_score(frame):
    """The total score the feedback page shows: (points, max points)."""
    text = frame.locator("body").inner_text()
    found = re.search(r"Score: ([\d.]+) / ([\d.]+)", text)
    assert found, f"the feedback page shows no score:\n{text[:2000]}"
    return float(found.group(1)), float(found.group(2))


def cannot_read(user, path):
    """`cat path` as `user` (runuser: the user's own permissions) fails for want of permission."""
    proc = subprocess.run(["runuser", "-u", user, "--", "cat", str(path)], capture_output=True, text=True,
                          timeout=30)
    return proc.returncode != 0 and "Permission denied" in proc.stderr


def can_read(user, path):
    return subprocess.run(["runuser", "-u", user, "--", "cat", str(path)], capture_output=True,
                          timeout=30).returncode == 0


def check_who_reads_what(hub):
    """Each student's permissions, checked as that user: nothing of the instructor's, nothing of another
    student's, and what they need; the instructor reads what grading needs."""
    klass = hub.klass
    course_root = Path(klass["course_root"])
    inbound = Path(klass["exchange"]) / klass["course_id"] / "inbound"
    own = next(p for p in inbound.glob(f"{A}+{ASSIGNMENT}+*") if p.owner() == A)  # B may forge one
    submission_of_a = own / f"{NOTEBOOK}.ipynb"
    secrets = {
        "the solutions": REPO / "solutions" / ASSIGNMENT / f"{NOTEBOOK}.ipynb",
        "the hidden checks": REPO / "autograder" / "dpgrader" / "orientation" / "checks.py",
        "the planted bugs": REPO / "autograder" / "dpgrader" / "orientation" / "bugs.py",
        "the gradebook": course_root / "autograder" / "gradebook.db",
        "the instructor's source notebook": course_root / "solutions" / ASSIGNMENT / f"{NOTEBOOK}.ipynb",
    }
    for what, path in secrets.items():
        assert path.exists(), path
        for student in (A, B):
            assert cannot_read(student, path), f"{student} can read {what} ({path})"
        assert can_read(INSTRUCTOR, path), f"the instructor cannot read {what} ({path})"
    work_of_a = hub.home(A) / ASSIGNMENT / f"{NOTEBOOK}.ipynb"
    assert cannot_read(B, work_of_a), f"B can read A's notebook ({work_of_a})"
    assert cannot_read(B, submission_of_a), f"B can read A's submission, its path known ({submission_of_a})"
    listing = subprocess.run(["runuser", "-u", B, "--", "ls", str(inbound)], capture_output=True, text=True)
    assert listing.returncode != 0 and "Permission denied" in listing.stderr, \
        f"B can list the exchange's inbound folder: {listing.stdout}"
    assert can_read(A, work_of_a) and can_read(B, hub.home(B) / ASSIGNMENT / f"{NOTEBOOK}.ipynb")
    released = REPO / "course" / ASSIGNMENT / f"{NOTEBOOK}.ipynb"
    assert can_read(B, released), "B cannot read the released notebook"
    assert can_read(INSTRUCTOR, submission_of_a), "the instructor cannot read A's submission"
    # and as a student's server sees the machine (its own view of the course's Python: hub/spawner.py)
    for what in ("the solutions", "the gradebook"):
        assert hub.run_as(A, "cat", str(secrets[what])).returncode != 0, f"A's server can read {what}"
    find = "import importlib.util as u; print(all(u.find_spec(m) for m in ('dpcourse', 'torch', 'nbgrader')))"
    seen = hub.run_as(A, "python", "-c", find)
    assert seen.stdout.strip() == "True", f"A's server cannot run the course's Python: {seen.stderr[-1500:]}"


class Clock:
    """How long each phase of the test took (into the hub's timings: browser-screenshots/.../timings.json)."""

    def __init__(self, timings):
        self.timings, self.started = timings, time.monotonic()
        self.last = self.started

    def mark(self, phase):
        now = time.monotonic()
        self.timings[phase] = round(now - self.last, 1)
        self.last = now

    def total(self, name):
        self.timings[name] = round(time.monotonic() - self.started, 1)


def forged_submission(hub):
    """B submits in A's name (`--student`, which nbgrader lets anyone give): the instructor's collect must
    not take it for A's (hub/config/instructor/nbgrader_config.py)."""
    nbgrader(hub, B, "submit", ASSIGNMENT, f"--student={A}")


def test_a_class_on_jupyterhub_from_release_to_feedback(hub, browser, shots):
    clock = Clock(hub.timings)

    # Everyone signs in at once (their servers start together); the instructor releases 00.
    teacher, page_a, page_b = (log_in(browser, hub, user) for user in (INSTRUCTOR, A, B))
    lab_ready(teacher, INSTRUCTOR)
    clock.mark("sign-in until JupyterLab (three users at once)")
    formgrader = open_formgrader(teacher)
    formgrader_action(teacher, formgrader, ASSIGNMENT, "assign", "Generate")
    formgrader_action(teacher, formgrader, ASSIGNMENT, "release", "Release")
    clock.mark("the instructor generates and releases 00")

    # Meanwhile, from the command line, C and D submit.
    first_round = InBackground(lambda: first_submissions_of_c_and_d(hub))
    first_round.start()

    # A fetches 00, writes my_slice, validates and submits.
    lab_ready(page_a, A)
    assignments_a = open_assignments(page_a)
    fetch(assignments_a, ASSIGNMENT)
    open_fetched_notebook(page_a, assignments_a, ASSIGNMENT, NOTEBOOK)
    ids = code_ids(hub.home(A) / ASSIGNMENT / f"{NOTEBOOK}.ipynb")
    solution = solution_of("my_slice").splitlines()[-1].strip()
    typed = replace_line(page_a, ids.index("my_slice"), STUB, solution)
    assert STUB not in typed, f"the editor holds, after typing:\n{typed}"
    verdict, text = validate(page_a, shots)
    assert verdict == "validation-failed" and "global_mean" in text and "my_slice" not in text, \
        f"with my_slice written, Validate should fail global_mean's tests only; it said {verdict}: {text}"
    page_a.locator(".lm-TabBar-tab", has_text="Assignments").click()
    submit(assignments_a, ASSIGNMENT)
    clock.mark("A fetches, writes my_slice, validates, submits")

    # B submits the released notebook unchanged.
    lab_ready(page_b, B)
    assignments_b = open_assignments(page_b)
    fetch(assignments_b, ASSIGNMENT)
    submit(assignments_b, ASSIGNMENT)
    clock.mark("B fetches and submits")

    first_round.join(timeout=300)
    second_round = InBackground(lambda: forged_submission(hub))
    second_round.start()
    check_who_reads_what(hub)
    second_round.join(timeout=300)
    clock.mark("C, D submit; B forges A's; the permissions, as each user (command line, waited for)")

    # The instructor sets the due date (now: after every submission so far), collects, grades with
    # `make autograde` in a terminal, releases the feedback.
    teacher.bring_to_front()
    set_due_date(teacher, formgrader, ASSIGNMENT, math.ceil(time.time()))
    said = formgrader_action(teacher, formgrader, ASSIGNMENT, "collect", "Collect")
    assert f"submitted in {A}'s name by {B}: not collected" in said, f"the collect said:\n{said}"
    until(teacher, lambda: submissions_count(formgrader, ASSIGNMENT) == "4",
          "the Formgrader did not count 4 submissions (A, B, C, D)", "step")
    collected = Path(hub.klass["course_root"]) / "autograder" / "submitted"
    assert solution in (collected / A / ASSIGNMENT / f"{NOTEBOOK}.ipynb").read_text(), \
        "A's collected notebook is not the one A submitted"
    late = InBackground(lambda: late_submission_of_c(hub))  # C, after the due date, while grading goes on
    late.start()
    terminal = open_terminal(teacher)
    status, output = run_autograde(hub, teacher, terminal, shots, "autograde")
    assert status != 0 and "not graded (1 of 4)" in output and f"{D}/{ASSIGNMENT}" in output, \
        f"`make autograde` should grade everyone but D and say why not D; it said ({status}):\n{output}"
    teacher.locator(".lm-TabBar-tab", has_text="Formgrader").click()
    formgrader_action(teacher, formgrader, ASSIGNMENT, "generate-feedback", "Generate Feedback")
    formgrader_action(teacher, formgrader, ASSIGNMENT, "release-feedback", "Release Feedback")
    clock.mark("the instructor collects, runs make autograde, generates and releases feedback")

    # A and B fetch their feedback: 3 / 6 and 0 / 6, without the hidden tests.
    for student, page, assignments, score in ((A, page_a, assignments_a, 3.0),
                                              (B, page_b, assignments_b, 0.0)):
        page.bring_to_front()
        link = fetch_feedback(assignments, ASSIGNMENT)
        if student == A:
            shots(assignments, "assignments-tab")
        frame = open_feedback(page, link, NOTEBOOK)
        assert feedback_score(frame) == (score, 6.0), f"{student}'s feedback shows {feedback_score(frame)}"
        if student == A:
            shots(page.locator(".jp-HTMLViewer:visible"), "feedback")
        html = next(hub.home(student).glob(f"{ASSIGNMENT}/feedback/*/{NOTEBOOK}.html")).read_text()
        for secret in SECRETS:
            assert secret not in html, f"{student}'s feedback reveals {secret!r}"
    clock.mark("A and B fetch and open their feedback")

    # C's late submission: collected and graded alone, the others keep their grades.
    late.join(timeout=120)
    teacher.bring_to_front()
    formgrader_action(teacher, formgrader, ASSIGNMENT, "collect", "Collect")
    teacher.locator(".lm-TabBar-tab", has_text="Terminal").click()
    status, output = run_autograde(hub, teacher, terminal, shots, "autograde-late", f"STUDENT={C}")
    assert status == 0 and "grading 1 submission" in output, f"`make autograde STUDENT={C}` said:\n{output}"

    course_root = Path(hub.klass["course_root"])
    with open(course_root / "autograder" / "grades.csv") as f:
        rows = {row["student_id"]: row for row in csv.DictReader(f)}
    scores = {student: float(row["score"]) for student, row in rows.items()}
    assert scores == {A: 3.0, B: 0.0, C: 6.0, D: 0.0, E: 0.0}, f"grades.csv has {scores}"
    assert rows[C]["timestamp"] > rows[C]["duedate"] > rows[A]["timestamp"], \
        f"C's submission should be late and A's on time: {rows[C]}, {rows[A]}"
    assert not rows[D]["timestamp"] and not rows[E]["timestamp"], (rows[D], rows[E])
    clock.mark("C's late submission collected and graded alone")
    clock.total("the class, from sign-in to the late grade")
