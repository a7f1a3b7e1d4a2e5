"""The solutions' own code, read from solutions/: for grader code that must BE a notebook's solution.

Planted bugs are edits of a solution cell (`solution_code`, dpgrader.planted), and the benchmarks race
the notebook's plain solution against the tuned version of the chapter (`solution_functions`: e.g.
dpgrader.ring_allreduce.tuned's textbook ring), so neither can drift from the notebook: they are
made from it each time.

    reduce_scatter, all_gather = solution_functions("04_ring_allreduce", "ring_reduce_scatter",
                                                    "ring_all_gather")
"""

import ast
import re
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[2]
SOLUTION_MARKERS = re.compile(r"^[ \t]*### (BEGIN|END) SOLUTION[ \t]*(\n|$)", re.M)


def notebook_cells(assignment):
    path = next((REPO / "solutions" / assignment).glob("*.ipynb"))
    return nbformat.read(path, as_version=4).cells


def solution_code(assignment, exercise):
    """The solution cell of `exercise` as a learner would write it: the source without markers."""
    for cell in notebook_cells(assignment):
        if cell.metadata.get("nbgrader", {}).get("grade_id") == exercise:
            return SOLUTION_MARKERS.sub("", cell.source)
    raise AssertionError(f"{assignment} has no cell with grade id {exercise!r}")


def solution_functions(assignment, *exercises):
    """The functions (or classes) that these exercises' solution cells define, in the order asked.

    They run in one namespace holding the notebook's imports (its cells' top-level import lines)
    and the solution cells' definitions, so one exercise's solution may call another's by name,
    as in the notebook."""
    namespace, names = _solved(assignment, exercises)
    return tuple(namespace[name] for name in names)


def solution_namespace(assignment, *exercises):
    """{name: definition} of everything these exercises' solution cells define (a cell may define several
    functions), run as solution_functions runs them."""
    namespace, _ = _solved(assignment, exercises)
    return namespace


def _solved(assignment, exercises):
    namespace = {"__name__": f"dpgrader.solutions.{assignment}"}
    imports = [node for cell in notebook_cells(assignment) if cell.cell_type == "code"
               for node in _top_level(cell.source) if isinstance(node, (ast.Import, ast.ImportFrom))]
    exec(compile(ast.Module(body=imports, type_ignores=[]), f"<{assignment} imports>", "exec"), namespace)
    names = []
    for exercise in exercises:
        code = solution_code(assignment, exercise)
        definitions = [n for n in _top_level(code) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        if not definitions:
            raise AssertionError(f"the solution cell of {assignment}/{exercise} defines nothing")
        exec(compile(code, f"<{assignment} solution {exercise}>", "exec"), namespace)
        names.append(definitions[0].name)
    return namespace, names


def _top_level(source):
    try:
        return ast.parse(source).body
    except SyntaxError:  # a cell magic or a demo: not Python the solutions need
        return []
