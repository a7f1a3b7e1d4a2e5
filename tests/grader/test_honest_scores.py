"""Scores that cannot mislead (the grader-trust issue, "honest scores" and "memory"): the maximum comes
from the assignment, so a deleted test cell scores 0 of its points and says so; an emptied or rewritten
test cell is graded with the instructor's test, not the learner's text; points written into a
submission's metadata are ignored; a notebook with no graded cell is an error, not 0/0; a rank that
eats memory fails its cell with a reason, and the other cells keep their points."""

import nbformat
import pytest

from grading import cell, grade, solution_path

pytestmark = pytest.mark.slow
MAX = {"test_my_slice_basic": 1, "test_my_slice_edge_cases": 2, "test_global_mean_basic": 1,
       "test_global_mean_unequal_shards": 2}


def edited(tmp_path, name, edit):
    """The solution of 00 with `edit(cells)` applied, saved as <tmp>/<name>/00_orientation.ipynb."""
    nb = nbformat.read(solution_path("00_orientation"), as_version=4)
    nb.cells = edit(nb.cells)
    path = tmp_path / name / "00_orientation.ipynb"
    path.parent.mkdir()
    nbformat.write(nb, path)
    return path


def by_id(cells, grade_id):
    return next(c for c in cells if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id)


def drop_test(cells):
    return [c for c in cells if c.metadata.get("nbgrader", {}).get("grade_id") != "test_global_mean_basic"]


def empty_tests_and_break_global_mean(cells):
    """A wrong global_mean whose test cells the learner emptied, with full points in their metadata."""
    by_id(cells, "global_mean").source = "def global_mean(x):\n    return x.mean()\n"
    for grade_id in ("test_global_mean_basic", "test_global_mean_unequal_shards"):
        test = by_id(cells, grade_id)
        test.source = "pass"
        test.metadata["nbgrader"]["points"] = 100
    return cells


def eat_memory(cells):
    """my_slice allocates far more than the sandbox allows, in the rank that runs it."""
    by_id(cells, "my_slice").source = ("def my_slice(data):\n"
                                      "    hog = [bytearray(1 << 30) for _ in range(64)]\n"
                                      "    return data[:1]\n")
    return cells


def test_deleted_emptied_and_inflated_test_cells_and_an_empty_notebook_score_honestly(tmp_path):
    paths = [edited(tmp_path, "deleted", drop_test),
             edited(tmp_path, "emptied", empty_tests_and_break_global_mean),
             edited(tmp_path, "empty", lambda cells: [])]
    deleted, emptied, empty = grade(paths)

    assert deleted["max_score"] == sum(MAX.values()) and deleted["score"] == sum(MAX.values()) - 1, deleted
    missing = cell(deleted, "test_global_mean_basic")
    assert missing["points"] == 0 and "missing from the notebook" in missing["message"], missing

    assert emptied["max_score"] == sum(MAX.values()), emptied
    for grade_id in ("test_global_mean_basic", "test_global_mean_unequal_shards"):
        judged = cell(emptied, grade_id)
        assert judged["points"] == 0 and judged["max_points"] == MAX[grade_id], judged
    assert emptied["score"] == MAX["test_my_slice_basic"] + MAX["test_my_slice_edge_cases"], emptied

    assert empty["score"] == 0 and "none of the graded cells" in empty.get("error", ""), empty


def test_a_rank_that_eats_memory_fails_its_cells_and_the_rest_keep_their_points(tmp_path, monkeypatch):
    monkeypatch.setenv("DPCOURSE_SANDBOX_MEMORY", str(2 << 30))
    (result,) = grade([edited(tmp_path, "hog", eat_memory)])
    for grade_id in ("test_my_slice_basic", "test_my_slice_edge_cases"):
        failed = cell(result, grade_id)
        assert failed["points"] == 0 and failed["message"] != "passed", failed
        assert "MemoryError" in failed["message"] or "memory" in failed["message"].lower(), failed
    assert result["score"] == MAX["test_global_mean_basic"] + MAX["test_global_mean_unequal_shards"], result
