"""Build an nbgrader notebook from a plain-text outline (an authoring aid, optional).

Cells are separated by marker lines:
    # %% md [GRADE_ID]           markdown; with an id it is a read-only nbgrader cell
    # %% code                    a demo the learner may edit and run
    # %% solution GRADE_ID       the learner's exercise (### BEGIN/END SOLUTION inside)
    # %% test GRADE_ID POINTS    a read-only autograded test cell
    # %% answer GRADE_ID POINTS  a free-text answer graded by hand
Usage: python autograder/nbbuild.py OUTLINE.txt OUT.ipynb
Notebooks can just as well be edited in JupyterLab with nbgrader's "Create
Assignment" toolbar; `make format` then normalises them for review.
"""

import sys

import nbformat


def nbgrader_meta(kind, grade_id, points):
    meta = {"grade": kind in ("test", "answer"), "grade_id": grade_id,
            "locked": kind in ("md", "test"), "schema_version": 3,
            "solution": kind in ("solution", "answer"), "task": False}
    if points is not None:
        meta["points"] = points
    return {"nbgrader": meta}


def build(text):
    nb = nbformat.v4.new_notebook()
    nb.metadata = {"kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python",
                                  "name": "python3"},
                   "language_info": {"name": "python"}}
    chunks = ("\n" + text).split("\n# %% ")[1:]
    for n, chunk in enumerate(chunks):
        header, _, body = chunk.partition("\n")
        kind, *rest = header.split()
        grade_id = rest[0] if rest else None
        points = float(rest[1]) if len(rest) > 1 else None
        body = body.strip("\n")
        if kind in ("md", "answer"):
            cell = nbformat.v4.new_markdown_cell(body)
        else:
            cell = nbformat.v4.new_code_cell(body)
        cell.id = grade_id or f"cell-{n}"
        if grade_id:
            cell.metadata = nbgrader_meta(kind, grade_id, points)
        nb.cells.append(cell)
    return nb


if __name__ == "__main__":
    source, target = sys.argv[1:3]
    with open(source) as f:
        nb = build(f.read())
    nbformat.validate(nb)
    nbformat.write(nb, target)
