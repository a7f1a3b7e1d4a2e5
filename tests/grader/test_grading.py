"""Every exercise graded for real: its solution gets full marks, the released notebook none, each of
its planted bugs loses the cells it should, with a message that says what is wrong, and every cell of
every graded notebook scores and reads (first line) as recorded in its chapter's expected_grades.json.

One test per exercise, tagged with the exercise's key (`pytest -m ring_all_reduce`). The judge runs
once per assignment and session (`judged`): on the cells of the exercises this session selected.
"""

import pytest

from grading import (
    ASSIGNMENTS,
    cell,
    comparable,
    differences,
    exercise_tests,
    expected_grades,
    expected_grades_path,
    first_line,
    variants_of,
)
from judging import judged_assignment
from markers import exercise_param

EXERCISES = [(assignment, key) for assignment in ASSIGNMENTS for key in exercise_tests(assignment)]


@pytest.fixture(scope="session")
def judged(request, tmp_path_factory):
    """judged(assignment): the assignment's notebooks judged once per session (per xdist worker), on
    the test cells of every exercise of it that this session runs."""
    done = {}

    def judged_for(assignment):
        if assignment not in done:
            wanted = sorted({item.callspec.params["exercise"] for item in request.session.items
                             if item.originalname == "test_exercise_graded"
                             and item.callspec.params["assignment"] == assignment})
            done[assignment] = judged_assignment(assignment, tmp_path_factory.mktemp(assignment),
                                                 exercises=wanted)
        return done[assignment]

    return judged_for


@pytest.mark.parametrize("assignment, exercise", [exercise_param(a, key) for a, key in EXERCISES])
def test_exercise_graded(assignment, exercise, judged):
    recorded = expected_grades(assignment)
    assert recorded is not None, (f"{assignment} has no recorded grades ({expected_grades_path(assignment)} "
                                  f"is missing): record them with tests/grader/record_grades.py {assignment}")
    graded, tests, problems = judged(assignment), exercise_tests(assignment)[exercise], []

    solution = graded["solution"]
    short = [c for c in solution["cells"] if c["grade_id"] in tests and c["points"] != c["max_points"]]
    if solution.get("error") or short:
        problems.append(f"solution scored {solution['score']}/{solution['max_score']}: "
                        + "; ".join(f"{c['grade_id']}: {c['message'][:300]}" for c in short)
                        + solution.get("error", ""))
    for c in graded["released"]["cells"]:
        if c["grade_id"] in tests and (c["points"] != 0 or "NotImplementedError" not in c["message"]):
            problems.append(f"released {c['grade_id']} scored {c['points']} or fails without naming "
                            f"NotImplementedError: {c['message'][:200]}")

    bugs = 0
    for name, spec in variants_of(assignment).items():
        result = graded.get(name)
        for grade_id, expected_message in spec["loses"].items():
            if grade_id not in tests:
                continue
            bugs += 1
            got = cell(result, grade_id)
            if got["points"] != 0:
                problems.append(f"planted bug {name}: {grade_id} scored {got['points']}, expected 0")
            elif expected_message not in got["message"]:
                problems.append(f"planted bug {name}: {grade_id} message lacks {expected_message!r}: "
                                f"{got['message'][:400]}")
        for grade_id in spec.get("keeps", []):
            if grade_id in tests and (got := cell(result, grade_id))["points"] != got["max_points"]:
                problems.append(f"planted bug {name}: {grade_id} should still pass: {got['message'][:300]}")
    if not bugs:
        problems.append(f"no planted bug loses a test cell of {exercise} ({', '.join(tests)})")

    # the same points and the same first lines as recorded (a deliberate change re-records the table)
    problems += [f"not as recorded: {line}"
                 for line in differences(graded, recorded, assignment, cells=tests)]
    assert not problems, "\n".join(problems)


def test_every_assignment_has_planted_bugs_and_recorded_grades():
    few = [a for a in ASSIGNMENTS if len(variants_of(a)) < 3]
    unrecorded = [a for a in ASSIGNMENTS if expected_grades(a) is None]
    assert not few, f"assignments with fewer than 3 planted bugs: {few}"
    assert not unrecorded, f"assignments without expected_grades.json: {unrecorded}"


def test_first_lines_are_compared_without_what_changes_from_run_to_run():
    raised = "LaunchError: rank 3 of 4 raised ValueError: x (so did ranks 0, 1 and 2)\nTraceback"
    assert first_line(raised) == "LaunchError: rank <r> of 4 raised ValueError: x (so did <ranks>)"
    timed = "started 1.25 ms after; it took 0.62 s (torch.save to /tmp/tmpab_c/checkpoint.pt)"
    assert first_line(timed) == "started <t> ms after; it took <t> s (torch.save to <tmp>)"
    every = "LaunchError: rank 1 of 3 raised RuntimeError: f on rank 1, stage 2 failed -- on rank 1"
    once = first_line(every)
    assert once == ("LaunchError: rank <r> of 3 raised RuntimeError: f on rank <r>, stage <s> failed "
                    "-- on rank 1")
    assert comparable(once) == comparable(first_line(once)) == once
    assert comparable("got 1.3702625713293435, now 2") == comparable("got 1.3702625713293437, now 2")
    assert comparable("got 1.37026, expected 2") != comparable("got 1.37027, expected 2")
    passed = {"points": 1.0, "max_points": 1.0, "message": "passed"}
    graded = {"solution": {"cells": [{"grade_id": "t", "manual": False, **passed}]}}
    assert differences(graded, {"solution": {"t": passed}}) == []
    assert differences(graded, {"solution": {"t": {**passed, "points": 0.0}}}) == [
        "solution, t: points 1.0, recorded 0.0"]
