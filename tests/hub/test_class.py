"""A class on JupyterHub (`make hub`), in Chromium, with each of nbgrader's exchanges.

The filesystem exchange (`make hub`), the whole class: the instructor releases notebook 00 from the
Formgrader; student A fetches it from the Assignments tab, writes my_slice, validates and submits;
student B submits it unchanged. The instructor collects, grades with `make autograde` in a terminal
(through the class's grading service: each submission in its own cgroup, as root), writes the class
report (`make report`) and opens it, generates and releases the feedback; A sees 3 / 6 with the hidden
tests cleared, B sees 0. From the command line, as the class's users: C submits twice (the latest counts)
and once more after the due date (collected and graded alone), D submits a file that is not a notebook
(reported, the others graded), E never submits (0); F puts a link to the solutions in place of the
notebook of their newest submission, G a FIFO (neither is collected; F's earlier real submission is);
H's my_slice is a fork bomb, J's a memory bomb (capped by their submission's limits, named in the
grading service's log, everyone else graded honestly); and no student may read the solutions, the
hidden checks, the gradebook, another's home or submission, or make a folder in the exchange's root.

ngshare (`make hub EXCHANGE=ngshare`), the exchange's steps and the same isolation, and what the hub's
limits do: the instructor releases, collects and autogrades with the Formgrader's buttons (its
Autograde button through the grading service too), A fetches, submits and fetches feedback in the
browser, B from the command line with their server's token; B can neither read A's submission, list
the submissions, submit in A's name nor make the instructor collect a link; A's memory bomb in their own
JupyterLab kills only A's kernel. (The rest of the class flow does not depend on the exchange, and is not
run twice: the test suite's time.)
"""

import csv
import json
import math
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import nbformat
import pytest
from browser.steps import appear, menu, open_path, replace_line, validate

from .conftest import INSTRUCTOR, REPO, STUDENTS
from .steps import (
    autograde_in_formgrader,
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

# both classes make the same system users (conftest.STUDENTS): never two at once
pytestmark = pytest.mark.xdist_group("hub_class")

ASSIGNMENT = NOTEBOOK = "00_orientation"
STUB = "raise NotImplementedError()"
# never in feedback (the solution's markers: what a collected link to the solutions would bring)
SECRETS = ("BEGIN HIDDEN TESTS", "dpgrader", "check_my_slice", "check_global_mean", "BEGIN SOLUTION")
A, B, C, D, E, F, G, H, J = (STUDENTS[k] for k in "abcdefghj")
SOLUTION = REPO / "solutions" / ASSIGNMENT / f"{NOTEBOOK}.ipynb"
RELEASED = REPO / "course" / ASSIGNMENT / f"{NOTEBOOK}.ipynb"  # what every student may read
FORK_BOMB = ("def my_slice(data):\n    import os, time\n    while True:\n        if os.fork() == 0:\n"
             "            time.sleep(600)\n            os._exit(0)\n")
MEMORY_BOMB = "def my_slice(data):\n    hog = [bytearray(1 << 30) for _ in range(64)]\n    return data[:1]\n"


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


def with_cells(path, sources):
    """The notebook at `path` with the cells of the exercises in `sources` replaced, as text."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        cell.source = sources.get(cell.metadata.get("nbgrader", {}).get("grade_id"), cell.source)
    return nbformat.writes(nb)


def nbgrader(hub, user, *args, token=None):
    """`nbgrader ARGS` as `user`, as their server would run it; fails the test if it fails."""
    proc = hub.run_as(user, "nbgrader", *args, token=token)
    assert proc.returncode == 0, f"nbgrader {' '.join(args)} as {user} failed:\n{proc.stdout}{proc.stderr}"
    return proc.stdout + proc.stderr


def own_submissions(hub, student):
    """The student's submission folders in the exchange's inbound folder, oldest first."""
    inbound = Path(hub.klass["exchange"]) / hub.klass["course_id"] / "inbound"
    return sorted((p for p in inbound.glob(f"{student}+{ASSIGNMENT}+*") if p.owner() == student),
                  key=lambda p: p.name.split("+")[2])


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


def first_submissions(hub):
    """C, D as below; F, G: attacks on the instructor's collect; H, J: bombs for the grader (three
    threads, as three people would); E leaves a folder in /tmp (as torch's compiler does) that `make
    hub-remove` must take away."""
    rounds = [InBackground(lambda step=step: step(hub))
              for step in (first_submissions_of_c_and_d, attacks_on_the_collect, bombs)]
    for steps in rounds:
        steps.start()
    assert hub.run_as(E, "mkdir", f"/tmp/torchinductor_{E}").returncode == 0
    for steps in rounds:
        steps.join(timeout=300)


def attacks_on_the_collect(hub):
    """F submits the released notebook, submits again, then replaces the notebook of that newest
    submission by a link to the solutions (issue 28: the instructor's collect followed it and F got the
    solution's points and the solution in their feedback); G replaces theirs by a FIFO (a copy would
    wait on it forever). Neither newest submission may be collected; F's first one is."""
    for student in (F, G):
        work = hub.home(student) / ASSIGNMENT / f"{NOTEBOOK}.ipynb"
        assert hub.run_as(student, "mkdir", str(work.parent)).returncode == 0
        write_as(hub, student, work, RELEASED.read_text())
        nbgrader(hub, student, "submit", ASSIGNMENT)
    nbgrader(hub, F, "submit", ASSIGNMENT)
    newest_of_f, only_of_g = own_submissions(hub, F)[-1], own_submissions(hub, G)[-1]
    link = newest_of_f / f"{NOTEBOOK}.ipynb"
    assert hub.run_as(F, "ln", "-sf", str(SOLUTION), str(link)).returncode == 0, "F could not make the link"
    fifo = only_of_g / f"{NOTEBOOK}.ipynb"
    assert hub.run_as(G, "rm", str(fifo)).returncode == 0
    assert hub.run_as(G, "mkfifo", str(fifo)).returncode == 0


def bombs(hub):
    """H's my_slice forks until it cannot; J's allocates 64 GiB."""
    for student, bomb in ((H, FORK_BOMB), (J, MEMORY_BOMB)):
        work = hub.home(student) / ASSIGNMENT / f"{NOTEBOOK}.ipynb"
        assert hub.run_as(student, "mkdir", str(work.parent)).returncode == 0
        write_as(hub, student, work, with_cells(RELEASED, {"my_slice": bomb,
                                                           "global_mean": solution_of("global_mean")}))
        nbgrader(hub, student, "submit", ASSIGNMENT)


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


def run_autograde(hub, page, terminal, shots, name, *make_args, target="autograde"):
    """`make autograde` (or `target`) typed in the instructor's terminal, as the README says; returns its
    exit status and output, which the command also leaves in the instructor's home (read from there: a
    terminal draws its text on a canvas)."""
    log, status = hub.home(INSTRUCTOR) / f"{name}.log", hub.home(INSTRUCTOR) / f"{name}.status"
    type_in_terminal(page, terminal, f'make -C "$DPCOURSE_REPO" {target} {" ".join(make_args)} 2>&1 '
                                     f'| tee ~/{log.name}; echo ${{PIPESTATUS[0]}} > ~/{status.name}')
    until(page, lambda: status.exists() and status.read_text().strip(),
          f"`make {target}` ({name}) typed in the terminal did not finish", "autograde")
    shots(page, name)
    return int(status.read_text()), log.read_text()


def open_class_report(page, shots):
    """The instructor opens dpcourse/autograder/class_report.html from their file browser."""
    page.locator(".jp-SideBar.jp-mod-left .lm-TabBar-tab[data-id='filebrowser']").click()
    crumbs = page.locator(".jp-FileBrowser .jp-BreadCrumbs-home")
    if crumbs.count():
        crumbs.first.click()  # the file browser from the home folder
    open_path(page, "dpcourse/autograder/class_report.html")
    frame = page.frame_locator(".jp-HTMLViewer:visible iframe")
    appear(frame.locator("h1", has_text="Class report"), "the class report in the HTML viewer", "lab")
    shots(page.locator(".jp-HTMLViewer:visible"), "class-report")
    return frame.locator("body").inner_text()


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
    claim = Path(klass["exchange"]) / "another-course"
    made = subprocess.run(["runuser", "-u", B, "--", "mkdir", str(claim)], capture_output=True, text=True)
    assert made.returncode != 0 and not claim.exists(), "B can make a course's folder in the exchange's root"
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


def check_the_bombs_were_capped(hub):
    """The grading service's log names H's and J's submissions as the ones whose processes reached their
    limits (the processes of one submission, the memory of one submission), and nobody else's."""
    lines = [line for line in hub.log.read_text(errors="replace").splitlines() if "[grading service]" in line]
    said = {student: [line for line in lines if f" {student}/{ASSIGNMENT}: judged" in line]
            for student in (A, B, C, F, H, J)}
    assert said[H] and "processes limit reached" in said[H][-1], f"the grading service said of H: {said[H]}"
    assert said[J] and "memory limit reached" in said[J][-1], f"the grading service said of J: {said[J]}"
    for student in (A, B, C, F):
        assert said[student] and "limit reached" not in said[student][-1], (student, said[student])


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

    # Meanwhile, from the command line, C, D, F, G, H and J submit.
    first_round = InBackground(lambda: first_submissions(hub))
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
    clock.mark("C, D, F, G, H, J submit; B forges A's; the permissions, as each user (command line)")

    # The instructor sets the due date (now: after every submission so far), collects, grades with
    # `make autograde` in a terminal, releases the feedback.
    teacher.bring_to_front()
    set_due_date(teacher, formgrader, ASSIGNMENT, math.ceil(time.time()))
    said = formgrader_action(teacher, formgrader, ASSIGNMENT, "collect", "Collect")
    assert f"submitted in {A}'s name by {B}: not collected" in said, f"the collect said:\n{said}"
    assert f"is not collected: {NOTEBOOK}.ipynb is a symbolic link" in said, f"the collect said:\n{said}"
    assert f"{F}'s submission of" in said and "is collected instead" in said, f"the collect said:\n{said}"
    assert f"{NOTEBOOK}.ipynb is a FIFO" in said and f"no submission of {G}'s is collected" in said, said
    until(teacher, lambda: submissions_count(formgrader, ASSIGNMENT) == "7",
          "the Formgrader did not count 7 submissions (A, B, C, D, F, H, J)", "step")
    collected = Path(hub.klass["course_root"]) / "autograder" / "submitted"
    assert solution in (collected / A / ASSIGNMENT / f"{NOTEBOOK}.ipynb").read_text(), \
        "A's collected notebook is not the one A submitted"
    assert (collected / F / ASSIGNMENT / f"{NOTEBOOK}.ipynb").read_text() == RELEASED.read_text(), \
        "F's collected notebook is not F's first (real) submission"
    assert not (collected / G).exists(), "something of G's was collected"
    late = InBackground(lambda: late_submission_of_c(hub))  # C, after the due date, while grading goes on
    late.start()
    terminal = open_terminal(teacher)
    status, output = run_autograde(hub, teacher, terminal, shots, "autograde")
    assert status != 0 and "not graded (1 of 7)" in output and f"{D}/{ASSIGNMENT}" in output, \
        f"`make autograde` should grade everyone but D and say why not D; it said ({status}):\n{output}"
    assert "timing the instructor's solution" in output and f"[1/1] {ASSIGNMENT}" in output, output[:3000]
    check_the_bombs_were_capped(hub)
    status, output = run_autograde(hub, teacher, terminal, shots, "report", target="report")
    assert status == 0 and "class_report.html" in output, f"`make report` said ({status}):\n{output}"
    report = open_class_report(teacher, shots)
    assert f"{D}/{ASSIGNMENT}" in report and "not a readable notebook" in report, report[:3000]
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
    for html in (Path(hub.klass["course_root"]) / "autograder" / "feedback").glob(f"*/{ASSIGNMENT}/*.html"):
        leaked = [secret for secret in SECRETS if secret in html.read_text()]
        assert not leaked, f"the feedback {html} reveals {leaked}"
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
    assert scores == {A: 3.0, B: 0.0, C: 6.0, D: 0.0, E: 0.0, F: 0.0, G: 0.0, H: 3.0, J: 3.0}, \
        f"grades.csv has {scores}"
    assert rows[C]["timestamp"] > rows[C]["duedate"] > rows[A]["timestamp"], \
        f"C's submission should be late and A's on time: {rows[C]}, {rows[A]}"
    assert not any(rows[s]["timestamp"] for s in (D, E, G)), (rows[D], rows[E], rows[G])
    clock.mark("C's late submission collected and graded alone")
    clock.total("the class, from sign-in to the late grade")


# ---- the exchange as a service (ngshare) -------------------------------------------------------------

def ngshare_get(hub, token, path):
    """GET of ngshare's API as the owner of `token`: (HTTP status, its JSON or text)."""
    request = urllib.request.Request(f"{hub.klass['ngshare_url']}/{path}",
                                     headers={"Authorization": f"token {token}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")[:300]


def what_b_may_not_do_with_ngshare(hub, token):
    """B, from the command line as their server: a link to the solutions in place of their notebook
    cannot be submitted (their server reads it as B), nor a submission in A's name; ngshare answers B's
    token with a refusal for A's submission, the list of submissions and the class list; ngshare's own
    files are closed to students. Then B submits the solution, for real."""
    work = hub.home(B) / ASSIGNMENT / f"{NOTEBOOK}.ipynb"
    nbgrader(hub, B, "fetch_assignment", ASSIGNMENT, token=token)
    assert hub.run_as(B, "ln", "-sf", str(SOLUTION), str(work)).returncode == 0
    linked = hub.run_as(B, "nbgrader", "submit", ASSIGNMENT, token=token)
    assert linked.returncode != 0 and "Permission denied" in linked.stdout + linked.stderr, \
        f"B submitted a link to the solutions:\n{linked.stdout}{linked.stderr}"
    assert hub.run_as(B, "rm", str(work)).returncode == 0
    write_as(hub, B, work, solved(RELEASED))
    forged = hub.run_as(B, "nbgrader", "submit", ASSIGNMENT, f"--student={A}", token=token)
    assert forged.returncode != 0 and "not possible with ngshare" in forged.stdout + forged.stderr, \
        f"B submitted in A's name:\n{forged.stdout}{forged.stderr}"
    nbgrader(hub, B, "submit", ASSIGNMENT, token=token)
    course = hub.klass["course_id"]
    for path in (f"submission/{course}/{ASSIGNMENT}/{A}", f"submissions/{course}/{ASSIGNMENT}",
                 f"submissions/{course}/{ASSIGNMENT}/{A}", f"students/{course}"):
        status, said = ngshare_get(hub, token, path)
        assert status == 403 and "Permission denied" in str(said), f"B's GET {path}: {status} {said}"
    status, own = ngshare_get(hub, token, f"submissions/{course}/{ASSIGNMENT}/{B}")
    assert status == 200 and len(own["submissions"]) == 1, f"B's own submissions: {status} {own}"
    for secret in (hub.root / "ngshare" / "ngshare.db", *(hub.root / "ngshare" / "files").iterdir()):
        assert cannot_read(B, secret), f"B can read ngshare's {secret}"


def memory_bomb_in_a_students_kernel(hub, page, shots):
    """A runs a cell that allocates without end in their own JupyterLab: their server's cgroup (the
    hub's limit, 2 GiB in this test) makes the kernel's OOM killer end that kernel, JupyterLab says so and
    restarts it; A's server and everyone else's go on."""
    sys.path.insert(0, str(REPO / "hub"))
    from user_cgroup import UserCgroup

    bomb = hub.home(A) / "bomb.ipynb"
    kernel = {"kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}}
    write_as(hub, A, bomb, nbformat.writes(nbformat.v4.new_notebook(metadata=kernel, cells=[
        nbformat.v4.new_code_cell("hog = []\nwhile True:\n    hog.append(bytearray(256 << 20))")])))
    servers = {user: hub.server_pid(user) for user in (A, INSTRUCTOR)}
    kills = UserCgroup(A).oom_kills()
    page.bring_to_front()
    page.goto(f"http://{A}.localhost:{hub.port}/user/{A}/lab/tree/bomb.ipynb")
    appear(page.locator(".jp-StatusBar-Widget", has_text=re.compile(r"\|\s*Idle")),
           "the kernel of bomb.ipynb (status 'Idle')", "lab")
    menu(page, "Run", "Run All Cells")
    appear(page.locator(".jp-Dialog", has_text="appears to have died"),
           "JupyterLab's dialog saying the kernel died", "cells")
    shots(page, "kernel-died")
    assert UserCgroup(A).oom_kills() > kills, "the kernel did not die by the memory limit of A's cgroup"
    assert {user: hub.server_pid(user) for user in (A, INSTRUCTOR)} == servers, \
        "a server died with A's kernel"


@pytest.mark.parametrize("hub", ["ngshare"], indirect=True)
def test_a_class_with_ngshare_its_exchange_steps_isolation_and_limits(hub, browser, shots):
    clock = Clock(hub.timings)
    teacher, page_a, page_b = (log_in(browser, hub, user) for user in (INSTRUCTOR, A, B))
    lab_ready(teacher, INSTRUCTOR)
    clock.mark("sign-in until JupyterLab (three users at once)")
    formgrader = open_formgrader(teacher)
    formgrader_action(teacher, formgrader, ASSIGNMENT, "assign", "Generate")
    formgrader_action(teacher, formgrader, ASSIGNMENT, "release", "Release")
    clock.mark("the instructor generates and releases 00 (to ngshare)")

    lab_ready(page_b, B)
    b_steps = InBackground(lambda: what_b_may_not_do_with_ngshare(hub, hub.server_token(B)))
    b_steps.start()
    lab_ready(page_a, A)
    assignments_a = open_assignments(page_a)
    fetch(assignments_a, ASSIGNMENT)
    submit(assignments_a, ASSIGNMENT)
    b_steps.join(timeout=300)
    clock.mark("A fetches and submits; B's attempts, then B submits (command line)")

    teacher.bring_to_front()
    said = formgrader_action(teacher, formgrader, ASSIGNMENT, "collect", "Collect")
    until(teacher, lambda: submissions_count(formgrader, ASSIGNMENT) == "2",
          f"the Formgrader did not count 2 submissions (A, B); the collect said:\n{said}", "step")
    collected = Path(hub.klass["course_root"]) / "autograder" / "submitted"
    assert "BEGIN SOLUTION" not in (collected / B / ASSIGNMENT / f"{NOTEBOOK}.ipynb").read_text()
    for student in (A, B):
        autograde_in_formgrader(formgrader, ASSIGNMENT, student)
    judged = [line for line in hub.log.read_text(errors="replace").splitlines()
              if "[grading service]" in line and f"/{ASSIGNMENT}: judged" in line]
    assert len(judged) == 2, f"the Autograde button did not judge through the grading service: {judged}"
    formgrader_action(teacher, formgrader, ASSIGNMENT, "generate-feedback", "Generate Feedback")
    formgrader_action(teacher, formgrader, ASSIGNMENT, "release-feedback", "Release Feedback")
    clock.mark("the instructor collects, autogrades (Formgrader's buttons), releases feedback")

    page_a.bring_to_front()
    frame = open_feedback(page_a, fetch_feedback(assignments_a, ASSIGNMENT), NOTEBOOK)
    assert feedback_score(frame) == (0.0, 6.0), f"A's feedback shows {feedback_score(frame)}"
    token = hub.server_token(B)
    nbgrader(hub, B, "fetch_feedback", ASSIGNMENT, token=token)
    html = next(hub.home(B).glob(f"{ASSIGNMENT}/feedback/*/{NOTEBOOK}.html")).read_text()
    assert "Score: 6.0 / 6.0" in re.sub(r"<[^>]+>", "", html), "B's feedback does not show 6 / 6"
    assert not [secret for secret in SECRETS if secret in html], "B's feedback reveals a secret"
    status, said = ngshare_get(hub, token, f"feedback/{hub.klass['course_id']}/{ASSIGNMENT}/{A}?timestamp=x")
    assert status == 403, f"B's token fetched A's feedback: {status} {said}"
    clock.mark("A (browser) and B (command line) fetch their feedback")

    memory_bomb_in_a_students_kernel(hub, page_a, shots)
    clock.mark("A's memory bomb in their own kernel")
    clock.total("the class with ngshare, from sign-in to the bomb")
