"""Grade learner notebooks with the real `nbgrader autograde`, in a scratch course, and report scores.

    python autograder/grade.py course/00_orientation/00_orientation.ipynb          # a table
    python autograder/grade.py my_copy.ipynb --json                                # one JSON object
    python autograder/grade.py a.ipynb b.ipynb --json                              # a JSON list

Each notebook becomes one "student" of a temporary course made from solutions/. The judge
(dpgrader.judge) gives every test cell its verdict, in a process of its own where the learner's
code never runs (one judge for all the notebooks of an assignment); meanwhile nbgrader, in this
process, records the assignment's cells (hidden tests included) in a fresh gradebook
(generate_assignment, cached); then `autograde` restores the test cells over each student's copy,
writes the verdicts as their outputs and scores them. Nothing in the repository's own gradebook or
folders is touched.

Exit status: 0 when every notebook could be graded (whatever its score), 2 otherwise.
"""

import argparse
import concurrent.futures
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

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
    """The notebook as JSON, or a GradingError saying what is wrong with the file.

    Plain JSON, not nbformat (whose import costs seconds, and the judge starts only after this
    check); nbgrader validates the notebook's schema when it records the grades.
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict) or data.get("nbformat") != 4 or not isinstance(data.get("cells"), list):
            raise ValueError("not a Jupyter notebook of format 4 with a list of cells")
        return data
    except FileNotFoundError:
        raise GradingError(f"{path}: no such file") from None
    except (ValueError, UnicodeDecodeError) as exc:  # json.JSONDecodeError is a ValueError
        raise GradingError(f"{path} is not a readable notebook ({type(exc).__name__}: {exc}). "
                           "Was it saved completely? Restore it from course/ and copy your code back."
                           ) from None


def grade(notebooks, assignment=None, keep=None, sandboxed=True):
    """Grade notebooks; return one result dict per notebook, in order.

    sandboxed=False runs the learner's code without the sandbox (a learner grading their own copy
    on a machine without bubblewrap); each result then says so ("sandboxed": false).
    """
    if sandboxed:
        from dpgrader.judge.sandbox import require

        require()
    results = [None] * len(notebooks)
    groups = {}
    taken = Path(tempfile.mkdtemp(prefix="dpcourse-taken-"))
    try:
        copies = []
        for i, nb in enumerate(notebooks):
            copies.append(taken / str(i) / Path(nb).name)
            try:
                take_notebook(nb, copies[i])
                read_notebook(copies[i])
                groups.setdefault(assignment or find_assignment(nb), []).append(i)
            except GradingError as exc:
                results[i] = {"notebook": str(nb), "assignment": assignment, "error": str(exc),
                              "score": 0.0, "max_score": None, "cells": []}
        for name, indices in groups.items():
            graded = _grade_assignment(name, [copies[i] for i in indices], keep, sandboxed)
            for i, result in zip(indices, graded, strict=True):
                results[i] = dict(result, notebook=str(notebooks[i]))
    finally:
        shutil.rmtree(taken, ignore_errors=True)
    for result in results:
        result["sandboxed"] = sandboxed
    return results


def take_notebook(path, copy):
    """Copy the notebook `path` to `copy` if it is a regular file (dpgrader.safe_copy: opened without
    following a link, no hard link); everything after reads the copy. GradingError otherwise."""
    from dpgrader.safe_copy import copy_regular_file

    copy.parent.mkdir(parents=True, exist_ok=True)
    refused = copy_regular_file(path, copy)
    if refused == "no such file":
        raise GradingError(f"{path}: no such file")
    if refused:
        raise GradingError(f"{path} is {refused}: only a regular file is graded (grade the notebook "
                           f"itself, not a link to it)" if refused.startswith("a ") else f"{path}: {refused}")


def _grade_assignment(assignment, notebooks, keep, sandboxed=True):
    """Judge the notebooks (one judge process for all), then record the verdicts with nbgrader."""
    from dpgrader.judge.process import save_verdicts
    from dpgrader.judge.record import Recorder

    root = Path(keep or tempfile.mkdtemp(prefix="dpcourse-grade-"))
    try:
        shutil.copytree(SOLUTIONS / assignment, root / "solutions" / assignment, dirs_exist_ok=True)
        name = _source_name(assignment, notebooks[0])
        students = [f"learner{i}" for i in range(len(notebooks))]
        paths = []
        for student, nb in zip(students, notebooks, strict=True):
            target = root / "autograder" / "submitted" / student / assignment
            target.mkdir(parents=True, exist_ok=True)
            paths.append(shutil.copy(nb, target / _source_name(assignment, nb)))  # take_notebook's copy
        with concurrent.futures.ThreadPoolExecutor(1) as worker:  # nbgrader loads while the judge works
            judged = worker.submit(_judged, SOLUTIONS / assignment / name, paths, sandboxed)
            book = Recorder(root, f"sqlite:///{root / 'gradebook.db'}", root / "autograder" / "verdicts",
                            sandboxed)
            log = _generated_gradebook(assignment, root, book)
            verdicts = judged.result()
        failed = {}
        for student, path in zip(students, paths, strict=True):
            verdict = verdicts[str(path)]
            if "error" in verdict:
                failed[student] = verdict["error"]
                continue
            save_verdicts(root / "autograder" / "verdicts", student, assignment, Path(path).stem, verdict)
        if len(failed) < len(students):
            log += _recorded(book, assignment, failed)
        return [_collect(root, assignment, student, nb, log, failed.get(student))
                for student, nb in zip(students, notebooks, strict=True)]
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


def _judged(source, paths, sandboxed):
    """{path: verdicts or {"error": why}}: one judge for all the notebooks (sandboxes start once)."""
    from dpgrader.judge.process import JudgeWorker

    with JudgeWorker(sandboxed) as worker:
        return {str(path): worker.judge(source, path) for path in paths}


def _recorded(book, assignment, failed):
    from dpgrader.judge.record import StepFailed

    try:
        return book.autograde(assignment, exclude=failed)
    except StepFailed as exc:
        return str(exc)


def _generated_gradebook(assignment, root, book):
    """Put the assignment's gradebook (what generate_assignment records) at root/gradebook.db.

    generate_assignment's result depends only on the instructor's notebooks and the nbgrader
    configuration: it is kept in a cache keyed by their contents (and the nbgrader version), so it
    runs once per change. The cache is outside every sandbox; a stale entry cannot be used,
    because any change to its inputs changes the key.
    """
    from dpgrader.judge.record import StepFailed

    cached = _gradebook_cache() / f"{assignment}-{_sources_key(assignment)}.db"
    if cached.exists():
        shutil.copy(cached, root / "gradebook.db")
        return ""
    try:
        log = book.generate(assignment)
    except StepFailed as exc:
        return str(exc)
    if (root / "gradebook.db").exists():
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(f".{os.getpid()}.tmp")
        shutil.copy(root / "gradebook.db", partial)
        os.replace(partial, cached)
    return log


def _gradebook_cache():
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dpcourse" / "gradebooks"


def _sources_key(assignment):
    import hashlib
    from importlib.metadata import version

    digest = hashlib.sha256(version("nbgrader").encode())
    for path in sorted((SOLUTIONS / assignment).rglob("*")) + [AUTOGRADER / "nbgrader_config.py"]:
        if path.is_file():
            digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _source_name(assignment, notebook):
    names = sorted(p.name for p in (SOLUTIONS / assignment).glob("*.ipynb"))
    return Path(notebook).name if Path(notebook).name in names else names[0]


def _collect(root, assignment, student, notebook, log, failure=None):
    """One notebook's result, with every graded cell the assignment has, from the gradebook.

    The maximum is the assignment's (a test cell the learner deleted or emptied still counts,
    at 0 points, and says so); a notebook with no graded cell at all is an error, not 0/0.
    Written answers are reported as graded by hand (points None) whatever the gradebook holds:
    only the instructor gives those points.
    """
    import nbformat  # loaded with nbgrader by now
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
        result["max_score"] = _max_score(gb, assignment, name)
        if failure or submission is None or not graded_path.exists():
            result["error"] = failure or "nbgrader could not autograde this notebook:\n" + _log_errors(log)
            return result
        grades = {g.name: g for g in submission.grades}
        graded = {c.metadata.get("nbgrader", {}).get("grade_id"): c
                  for c in nbformat.read(graded_path, as_version=4).cells
                  if c.metadata.get("nbgrader", {}).get("grade")}
        for grade_cell in _grade_cells(gb, assignment, name):
            cell, grade = graded.get(grade_cell.name), grades.get(grade_cell.name)
            result["cells"].append(_cell_result(grade_cell, cell, grade))
    if not graded:
        result["error"] = (f"{notebook} has none of the graded cells of {assignment}: it scores 0. Is it "
                           f"the assignment's notebook, saved completely? Start again from course/.")
    result["score"] = float(sum(c["points"] or 0 for c in result["cells"]))
    return result


def _grade_cells(gb, assignment, name):
    """The assignment's graded cells in notebook order, as generate_assignment recorded them."""
    notebook = gb.find_notebook(Path(name).stem, assignment)
    order = {c.name: i for i, c in enumerate(notebook.source_cells)}
    return sorted(notebook.grade_cells, key=lambda c: order.get(c.name, len(order)))


def _cell_result(grade_cell, cell, grade):
    manual = grade_cell.cell_type == "markdown" or bool(getattr(grade_cell, "solution", False))
    if cell is None or grade is None:
        return {"grade_id": grade_cell.name, "points": None if manual else 0.0,
                "max_points": grade_cell.max_score, "manual": manual,
                "message": f"this graded cell is missing from the notebook (deleted or its metadata "
                           f"edited): 0 of its {grade_cell.max_score:g} points. Restore it from course/."}
    if manual:
        return {"grade_id": grade_cell.name, "points": None, "max_points": grade_cell.max_score,
                "manual": True, "message": _message(cell, None, grade_cell.max_score)}
    points = grade.auto_score if grade.auto_score is not None else 0.0
    return {"grade_id": grade_cell.name, "points": points, "max_points": grade_cell.max_score,
            "manual": False, "message": _message(cell, points, grade_cell.max_score)}


def _message(cell, points, max_points):
    if cell.metadata.get("nbgrader", {}).get("solution"):
        unchanged = "YOUR ANSWER HERE" in cell.source
        return ("answer unchanged: write your answer (graded by hand)" if unchanged
                else "answer graded by hand by the instructor")
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
    if not result.get("sandboxed", True):
        print("  (graded without the sandbox: --no-sandbox)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="+", help="learner notebooks to grade")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--assignment", help="assignment name (default: found from the file name)")
    parser.add_argument("--keep", help="grade in this folder and keep it (to inspect nbgrader's work)")
    parser.add_argument("--no-sandbox", action="store_true",
                        help="run your code without the grading sandbox (when bubblewrap is missing); "
                             "the report says so")
    args = parser.parse_args(argv)
    try:
        results = grade(args.notebooks, args.assignment, args.keep, sandboxed=not args.no_sandbox)
    except Exception as exc:  # noqa: BLE001 - SandboxUnavailable and friends: say why, exit 2
        if type(exc).__name__ != "SandboxUnavailable":
            raise
        print(f"grading refused: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else results, indent=2))
    else:
        for result in results:
            print_table(result)
    return 2 if any(r.get("error") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
