"""Every assignment graded for real: the solution gets full marks, the released notebook and each
planted bug lose points, with messages that say what is wrong, and every cell of every graded
notebook scores and reads (first line) as recorded in expected_grades.json."""

import json

import pytest

from grading import ASSIGNMENTS, EXPECTED_GRADES, cell, differences, first_line, variants_of
from judging import judged_assignment

EXPECTED = json.loads(EXPECTED_GRADES.read_text())


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_solution_full_marks_released_zero_and_planted_bugs_lose_points(assignment, tmp_path):
    graded = judged_assignment(assignment, tmp_path)
    problems = []

    # written answers are graded by hand: left out here (grade.py marks them "manual")
    solution = graded["solution"]
    short = [c for c in solution["cells"] if not c["manual"] and c["points"] != c["max_points"]]
    if solution.get("error") or short or not solution["cells"]:
        problems.append(f"solution scored {solution['score']}/{solution['max_score']}: "
                        + "; ".join(f"{c['grade_id']}: {c['message'][:300]}" for c in short)
                        + solution.get("error", ""))

    released = graded["released"]
    auto = [c for c in released["cells"] if not c["manual"]]
    if not auto or any(c["points"] != 0 for c in auto):
        problems.append("released notebook passes "
                        + ", ".join(c["grade_id"] for c in auto if c["points"]))
    for c in auto:
        if "NotImplementedError" not in c["message"]:
            problems.append(f"released {c['grade_id']} fails without naming NotImplementedError: "
                            f"{c['message'][:200]}")

    for name, spec in variants_of(assignment).items():
        result = graded[name]
        for grade_id, expected_message in spec["loses"].items():
            got = cell(result, grade_id)
            if got["points"] != 0:
                problems.append(f"variant {name}: {grade_id} scored {got['points']}, expected 0")
            elif expected_message not in got["message"]:
                problems.append(f"variant {name}: {grade_id} message lacks {expected_message!r}: "
                                f"{got['message'][:400]}")
        for grade_id in spec.get("keeps", []):
            got = cell(result, grade_id)
            if got["points"] != got["max_points"]:
                problems.append(f"variant {name}: {grade_id} should still pass: {got['message'][:300]}")

    # the same points and the same first lines as recorded (a deliberate change re-records the table)
    if assignment in EXPECTED:
        problems += [f"not as recorded: {line}"
                     for line in differences(graded, EXPECTED[assignment], assignment)]
    assert not problems, "\n".join(problems)


def test_every_assignment_has_planted_bugs():
    missing = [a for a in ASSIGNMENTS if len(variants_of(a)) < 3]
    assert not missing, f"assignments with fewer than 3 planted bugs: {missing}"



def test_first_lines_are_compared_without_what_changes_from_run_to_run():
    raised = "LaunchError: rank 3 of 4 raised ValueError: x (so did ranks 0, 1 and 2)\nTraceback"
    assert first_line(raised) == "LaunchError: rank <r> of 4 raised ValueError: x (so did <ranks>)"
    timed = "started 1.25 ms after; it took 0.62 s (torch.save to /tmp/tmpab_c/checkpoint.pt)"
    assert first_line(timed) == "started <t> ms after; it took <t> s (torch.save to <tmp>)"
    passed = {"points": 1.0, "max_points": 1.0, "message": "passed"}
    graded = {"solution": {"cells": [{"grade_id": "t", "manual": False, **passed}]}}
    assert differences(graded, {"solution": {"t": passed}}) == []
    assert differences(graded, {"solution": {"t": {**passed, "points": 0.0}}}) == [
        "solution, t: points 1.0, recorded 0.0"]
