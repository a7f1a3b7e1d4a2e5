"""Judge an assignment's notebooks directly, as the grader does, without a kernel or nbgrader.

Scores come from the judge's verdicts only (nbgrader writes them into its gradebook unchanged,
and tests/grader/test_class_autograde.py runs that whole pipeline), so the solution, the
released notebook and every planted bug of an assignment are judged by one process that keeps
its sandboxes warm: each notebook costs its test cells, not a kernel and an nbgrader run. A
planted bug is judged only on the cells it lists (loses and keeps).
"""

import json
import os
import subprocess
import sys

from conftest import REPO
from grading import exercise_tests, notebook_name, released_path, solution_path, variants_of, write_variant

MESSAGE_LINES = 25  # as autograder/grade.py reports a failure


def judged_assignment(assignment, tmp_root, deadline=15, exercises=None):
    """{"solution": result, "released": result, <bug name>: result}, results as grade.py gives them.

    exercises: judge only the test cells of these exercise keys (the solution's and the released
    notebook's, and the planted bugs that list one of them); None: every cell of every notebook.
    """
    cells = None
    if exercises is not None:
        tests = exercise_tests(assignment)
        cells = sorted({t for key in exercises for t in tests[key]})
    jobs = {"solution": (solution_path(assignment), cells), "released": (released_path(assignment), cells)}
    for name, spec in variants_of(assignment).items():
        only = sorted(set(spec["loses"]) | set(spec.get("keeps", [])))
        if cells is None or set(only) & set(cells):
            path = write_variant(assignment, spec["cells"], tmp_root / assignment / name)
            jobs[name] = (path, only)
    return judge_jobs(assignment, jobs, tmp_root, deadline)


def judge_jobs(assignment, jobs, tmp_root, deadline=15):
    """{name: result} for jobs {name: (notebook path, grade ids to judge or None)}, judged in one process."""
    spec_file = tmp_root / f"{assignment}-jobs.json"
    spec_file.write_text(
        json.dumps([{"submission": str(path), "only": only} for path, only in jobs.values()])
    )
    out = tmp_root / f"{assignment}-verdicts.json"
    source = REPO / "solutions" / assignment / notebook_name(assignment)
    env = dict(os.environ, DPCOURSE_DEADLINE=str(deadline), PYTHONPATH=str(REPO / "autograder"))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dpgrader.judge",
            str(source),
            "--spec",
            str(spec_file),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
        cwd=REPO / "autograder",
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    verdicts = json.loads(out.read_text())
    return {name: result_of(assignment, path, verdicts[str(path)]) for name, (path, _) in jobs.items()}


def result_of(assignment, path, verdicts):
    """grade.py's result for one notebook, from the judge's verdicts on its test cells."""
    source = json.loads((REPO / "solutions" / assignment / notebook_name(assignment)).read_text())
    cells = []
    for cell in source["cells"]:
        meta = cell["metadata"].get("nbgrader", {})
        if not meta.get("grade"):
            continue
        if meta.get("solution"):
            cells.append(
                {
                    "grade_id": meta["grade_id"],
                    "points": None,
                    "max_points": meta["points"],
                    "manual": True,
                    "message": "answer graded by hand by the instructor",
                }
            )
        elif meta["grade_id"] in verdicts:
            verdict = verdicts[meta["grade_id"]]
            message = (
                "passed"
                if verdict["passed"]
                else "\n".join(
                    f"{verdict['ename']}: {verdict['evalue']}".strip().splitlines()[:MESSAGE_LINES]
                )
            )
            cells.append(
                {
                    "grade_id": meta["grade_id"],
                    "points": meta["points"] if verdict["passed"] else 0.0,
                    "max_points": meta["points"],
                    "manual": False,
                    "message": message,
                    "output": verdict.get("output") or "",  # what the cell printed
                }
            )
    score = float(sum(c["points"] or 0 for c in cells))
    return {
        "notebook": str(path),
        "assignment": assignment,
        "score": score,
        "max_score": float(sum(c["max_points"] for c in cells)),
        "cells": cells,
    }
