"""A learner in the browser: notebook 00 in JupyterLab as `make lab` serves it, run, solved, validated."""

import shutil
import subprocess

import nbformat
import pytest

from markers import exercise

from .conftest import REPO
from .steps import (
    code_cells,
    notebook,
    open_lab,
    open_notebook,
    replace_line,
    run_all_cells,
    run_cell,
    unexpected_errors,
    validate,
)

NOTEBOOK = "00_orientation/00_orientation.ipynb"
STUB = "raise NotImplementedError()"
SOLUTION = "return data[dist.get_rank()::dist.get_world_size()]"
NOT_WRITTEN = "not written yet"  # what a test cell says while the learner's function is the stub


@pytest.fixture
def course_copy(tmp_path):
    """A scratch copy of course/ for `make lab` to serve (LAB_ROOT): what the learner types, and what
    Validate saves, lands there and never in the repository's notebooks."""
    root = tmp_path / "course"
    shutil.copytree(REPO / "course", root, ignore=shutil.ignore_patterns("dpcourse", ".ipynb_checkpoints"))
    return root


def grade_ids(path):
    """nbgrader's grade_id of each code cell of a notebook (None for an ordinary cell), in order."""
    cells = nbformat.read(path, as_version=4).cells
    return [c.metadata.get("nbgrader", {}).get("grade_id") for c in cells if c.cell_type == "code"]


@exercise("my_slice")
def test_learner_runs_notebook_00_writes_my_slice_and_validates(start_server, page, shots, course_copy):
    server = start_server("lab", make_vars=[f"LAB_ROOT={course_copy}"])
    open_lab(page, server)
    shots(page, "file-browser")
    open_notebook(page, NOTEBOOK)
    ids = grade_ids(course_copy / NOTEBOOK)
    tests = [i for i, g in enumerate(ids) if g and g.startswith("test_")]

    cells = run_all_cells(page)
    shots(page, "ran-all-cells")
    errors = unexpected_errors(cells, lambda i, error: NOT_WRITTEN in error)
    assert not errors, f"cells of the released notebook fail, not for an exercise not written yet: {errors}"
    for i in tests:
        assert "NotImplementedError" in cells[i]["error"] and NOT_WRITTEN in cells[i]["error"], \
            f"the test cell {ids[i]} does not say its exercise is not written yet: {cells[i]}"
    basic = ids.index("test_my_slice_basic")
    shots(notebook(page).locator(".jp-CodeCell").nth(basic), "test-cell-not-written-yet")

    verdict, text = validate(page, shots)
    assert verdict == "validation-failed" and "my_slice" in text and "global_mean" in text, \
        f"Validate on the released notebook should fail both exercises' tests; it said {verdict}: {text}"

    exercise = ids.index("my_slice")
    typed = replace_line(page, exercise, STUB, SOLUTION).replace("\u00a0", " ")
    assert SOLUTION in typed and STUB not in typed, f"the editor holds, after typing:\n{typed}"
    assert not run_cell(page, exercise)["error"]
    shown = run_cell(page, basic)
    assert not shown["error"] and "my_slice passes the visible test" in shown["text"], shown
    shots(notebook(page).locator(".jp-CodeCell").nth(basic), "test-cell-passes")
    assert not any(c["error"] for c in code_cells(page)[exercise:basic + 1])

    verdict, text = validate(page, shots)
    assert verdict == "validation-failed" and "global_mean" in text and "my_slice" not in text, \
        f"after my_slice is written, Validate should fail global_mean's tests only; it said {verdict}: {text}"

    changed = subprocess.run(["git", "status", "--porcelain", "course"], cwd=REPO, capture_output=True,
                             text=True).stdout
    assert not changed, f"the test changed the repository's course/: {changed}"
