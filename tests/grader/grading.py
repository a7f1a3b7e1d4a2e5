"""Grade notebooks in tests: the solution, the released version and planted-bug variants.

A variant is the released notebook with some solution cells replaced by buggy
code (tests/grader/variants/<assignment>.py holds them). All notebooks of one
assignment go through one `grade.py` run (one nbgrader autograde, several
"students"), which is what keeps `make test` within its time budget.
"""

import importlib
import json
import os
import subprocess
import sys

import nbformat

from conftest import REPO

ASSIGNMENTS = sorted(p.name for p in (REPO / "solutions").glob("[0-9]*") if p.is_dir())


def notebook_name(assignment):
    return next((REPO / "solutions" / assignment).glob("*.ipynb")).name


def solution_path(assignment):
    return REPO / "solutions" / assignment / notebook_name(assignment)


def released_path(assignment):
    return REPO / "course" / assignment / notebook_name(assignment)


def variants_of(assignment):
    """The planted bugs of an assignment: {name: {"cells": {grade_id: source}, "loses", "keeps"}}.

    A variants module holds either BUGS, a list of planted.Bug (edits of the solution), or the
    older VARIANTS dict of whole cells.
    """
    try:
        module = importlib.import_module(f"variants.v{assignment}")
    except ModuleNotFoundError:
        return {}
    if hasattr(module, "BUGS"):
        names = [bug.name for bug in module.BUGS]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        assert not duplicates, f"planted bugs of {assignment} share names: {duplicates}"
        return {bug.name: {"cells": bug.cell_sources(assignment), "loses": bug.loses, "keeps": bug.keeps,
                           "exercise": bug.exercise} for bug in module.BUGS}
    return module.VARIANTS


def write_variant(assignment, cells, folder):
    """The released notebook with the solution cells `cells` (grade_id -> source) replaced."""
    nb = nbformat.read(released_path(assignment), as_version=4)
    missing = set(cells)
    for cell in nb.cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id in cells:
            cell.source = cells[grade_id]
            missing.discard(grade_id)
    assert not missing, f"no cells {sorted(missing)} in {assignment}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / notebook_name(assignment)
    nbformat.write(nb, path)
    return path


def grade(paths, deadline=15):
    """Run grade.py on notebooks (one assignment per call is fastest); return its JSON results."""
    env = dict(os.environ, DPCOURSE_DEADLINE=str(deadline))
    proc = subprocess.run([sys.executable, str(REPO / "autograder" / "grade.py"), *map(str, paths),
                           "--json"], capture_output=True, text=True, env=env, timeout=1800)
    assert proc.returncode in (0, 2), proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    return results if isinstance(results, list) else [results]


def graded_assignment(assignment, tmp_root):
    """Grade solution, released notebook and every variant of an assignment in one run.

    Returns {"solution": result, "released": result, <variant name>: result}.
    """
    variants = variants_of(assignment)
    names = ["solution", "released", *variants]
    paths = [solution_path(assignment), released_path(assignment)]
    for name, spec in variants.items():
        paths.append(write_variant(assignment, spec["cells"], tmp_root / assignment / name))
    return dict(zip(names, grade(paths), strict=True))


def cell(result, grade_id):
    found = [c for c in result["cells"] if c["grade_id"] == grade_id]
    assert found, f"no graded cell {grade_id} in {result['notebook']}: {json.dumps(result)[:500]}"
    return found[0]
