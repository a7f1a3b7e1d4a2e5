"""Grade learner notebooks with the real `nbgrader autograde`, in a scratch course, and report scores.

    python autograder/grade.py course/00_orientation/00_orientation.ipynb          # a table
    python autograder/grade.py my_copy.ipynb --json                                # one JSON object
    python autograder/grade.py a.ipynb b.ipynb --json                              # a JSON list

Each notebook becomes one "student" of a temporary course made from solutions/:
generate_assignment records the test cells (hidden tests included) in a fresh
gradebook, autograde restores them over the student's copy, executes it and
scores it. Nothing in the repository's own gradebook or folders is touched.
Several notebooks of one assignment are graded in a single nbgrader run.

Exit status: 0 when every notebook could be graded (whatever its score), 2 otherwise.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat

AUTOGRADER = Path(__file__).resolve().parent
REPO = AUTOGRADER.parent
SOLUTIONS = REPO / "solutions"
MESSAGE_LINES = 25


class GradingError(Exception):
    """The notebook could not be graded at all (not a notebook, unknown assignment, ...)."""


def find_assignment(notebook):
    """The assignment a notebook belongs to: the solutions/ folder holding a notebook of that name."""
    matches = sorted(p.parent.name for p in SOLUTIONS.glob(f"*/{Path(notebook).name}"))
    if not matches:
        known = ", ".join(sorted(p.name for p in SOLUTIONS.glob("*/*.ipynb")))
        raise GradingError(f"{notebook}: no assignment has a notebook named {Path(notebook).name!r} "
                           f"(known: {known}). Keep the released file name, or pass --assignment.")
    return matches[0]


def read_notebook(path):
    try:
        return nbformat.read(path, as_version=4)
    except FileNotFoundError:
        raise GradingError(f"{path}: no such file") from None
    except Exception as exc:  # nbformat raises several types for broken JSON or schema
        raise GradingError(f"{path} is not a readable notebook ({type(exc).__name__}: {exc}). "
                           "Was it saved completely? Restore it from course/ and copy your code back."
                           ) from None


def grade(notebooks, assignment=None, keep=None):
    """Grade notebooks; return one result dict per notebook, in order."""
    results = [None] * len(notebooks)
    groups = {}
    for i, nb in enumerate(notebooks):
        try:
            read_notebook(nb)
            groups.setdefault(assignment or find_assignment(nb), []).append(i)
        except GradingError as exc:
            results[i] = {"notebook": str(nb), "assignment": assignment, "error": str(exc),
                          "score": 0.0, "max_score": None, "cells": []}
    for name, indices in groups.items():
        for i, result in zip(indices, _grade_assignment(name, [notebooks[i] for i in indices], keep),
                             strict=True):
            results[i] = result
    return results


def _grade_assignment(assignment, notebooks, keep):
    root = Path(keep or tempfile.mkdtemp(prefix="dpcourse-grade-"))
    try:
        shutil.copytree(SOLUTIONS / assignment, root / "solutions" / assignment, dirs_exist_ok=True)
        students = [f"learner{i}" for i in range(len(notebooks))]
        for student, nb in zip(students, notebooks, strict=True):
            target = root / "autograder" / "submitted" / student / assignment
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy(nb, target / _source_name(assignment, nb))
        env = dict(os.environ, DPCOURSE_COURSE_ROOT=str(root),
                   DPCOURSE_DB_URL=f"sqlite:///{root / 'gradebook.db'}")
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        log = _nbgrader(["generate_assignment", assignment, "--force"], env)
        log += _nbgrader(["autograde", assignment, "--force"], env)
        return [_collect(root, assignment, student, nb, log)
                for student, nb in zip(students, notebooks, strict=True)]
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


def _source_name(assignment, notebook):
    names = sorted(p.name for p in (SOLUTIONS / assignment).glob("*.ipynb"))
    return Path(notebook).name if Path(notebook).name in names else names[0]


def _nbgrader(args, env):
    proc = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=AUTOGRADER, env=env,
                          capture_output=True, text=True, timeout=3600)
    return proc.stdout + proc.stderr


def _collect(root, assignment, student, notebook, log):
    from nbgrader.api import Gradebook, MissingEntry

    name = _source_name(assignment, notebook)
    result = {"notebook": str(notebook), "assignment": assignment, "score": 0.0, "max_score": None,
              "cells": []}
    graded_path = root / "autograder" / "autograded" / student / assignment / name
    with Gradebook(f"sqlite:///{root / 'gradebook.db'}") as gb:
        try:
            submission = gb.find_submission_notebook(Path(name).stem, assignment, student)
        except MissingEntry:
            submission = None
        if submission is None or not graded_path.exists():
            result["error"] = "nbgrader could not autograde this notebook:\n" + _log_errors(log)
            result["max_score"] = _max_score(gb, assignment, name)
            return result
        grades = {g.name: g for g in submission.grades}
        graded = nbformat.read(graded_path, as_version=4)
        for cell in graded.cells:
            meta = cell.metadata.get("nbgrader", {})
            if meta.get("grade") and meta.get("grade_id") in grades:
                result["cells"].append(_cell_result(cell, grades[meta["grade_id"]]))
        result["score"] = float(sum(c["points"] or 0 for c in result["cells"]))
        result["max_score"] = float(sum(c["max_points"] for c in result["cells"]))
    return result


def _cell_result(cell, grade):
    """One graded cell. `manual` cells (written answers) are graded by hand: an untouched answer
    gets 0 from nbgrader, an edited one gets points None until the instructor grades it."""
    points = grade.score if grade.auto_score is not None or grade.manual_score is not None else None
    manual = bool(cell.metadata.get("nbgrader", {}).get("solution"))
    return {"grade_id": grade.name, "points": points, "max_points": grade.max_score,
            "manual": manual, "message": _message(cell, points, grade.max_score)}


def _message(cell, points, max_points):
    if cell.metadata.get("nbgrader", {}).get("solution"):
        return ("answer graded by hand by the instructor" if points is None
                else "answer unchanged: write your answer (graded by hand)")
    for out in cell.get("outputs", []):
        if out.output_type == "error":
            text = f"{out.ename}: {out.evalue}".strip().splitlines()
            return "\n".join(text[:MESSAGE_LINES])
    for out in cell.get("outputs", []):
        if out.output_type == "stream" and out.name == "stderr":
            text = out.text.strip().splitlines()[:MESSAGE_LINES]
            return "the cell wrote to stderr, which nbgrader scores 0:\n" + "\n".join(text)
    return "passed" if points == max_points else "partial credit"


def _max_score(gb, assignment, name):
    try:
        return float(gb.find_notebook(Path(name).stem, assignment).max_score)
    except Exception:  # noqa: BLE001 - the score is informative only
        return None


def _log_errors(log):
    lines = [line for line in log.splitlines() if "ERROR" in line or "Error" in line]
    return "\n".join((lines or log.splitlines())[-MESSAGE_LINES:])


def print_table(result):
    print(f"{result['notebook']}  ({result['assignment']})")
    if result.get("error"):
        print(f"  could not be graded: {result['error']}")
    for cell in result["cells"]:
        points = "hand" if cell["points"] is None else f"{cell['points']:g}"
        print(f"  {cell['grade_id']:<40} {points:>4} / {cell['max_points']:g}   "
              f"{cell['message'].splitlines()[0] if cell['message'] else ''}")
        for line in cell["message"].splitlines()[1:]:
            print(f"  {'':<40} {'':>4}     {line}")
    max_score = result["max_score"]
    print(f"  score: {result['score']:g} / {max_score:g}" if max_score is not None else "  score: 0")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="+", help="learner notebooks to grade")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--assignment", help="assignment name (default: found from the file name)")
    parser.add_argument("--keep", help="grade in this folder and keep it (to inspect nbgrader's work)")
    args = parser.parse_args(argv)
    results = grade(args.notebooks, args.assignment, args.keep)
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else results, indent=2))
    else:
        for result in results:
            print_table(result)
    return 2 if any(r.get("error") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
