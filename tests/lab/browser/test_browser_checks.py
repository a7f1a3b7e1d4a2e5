"""The suite's own check: a notebook cell that fails is caught and named (else a broken notebook could
pass the learner's test), and the run goes on past it, as a learner's would."""

import nbformat

from .steps import open_lab, open_notebook, run_all_cells, unexpected_errors


def test_a_failing_cell_is_reported(start_server, page, tmp_path):
    root = tmp_path / "course"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in (
        "print('before')", "def broken():\n    return 1 / 0\n\nbroken()", "print('after')")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                 "language": "python"}
    (root / "broken").mkdir(parents=True)
    nbformat.write(nb, root / "broken" / "broken.ipynb")
    server = start_server("lab", make_vars=[f"LAB_ROOT={root}"])
    open_lab(page, server)
    open_notebook(page, "broken/broken.ipynb")
    cells = run_all_cells(page)
    assert "after" in cells[2]["text"], "the run stopped at the failing cell"
    errors = unexpected_errors(cells, lambda i, error: "not written yet" in error)
    assert len(errors) == 1 and "code cell 1" in errors[0] and "ZeroDivisionError" in errors[0], errors
