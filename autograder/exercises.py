"""The exercise index: generated from solutions/, written to exercises.json and the README table.

    python autograder/exercises.py          # rewrite autograder/exercises.json and README.md's table
    python autograder/exercises.py --check  # exit 1 if either is stale (the tests run this)

An exercise is a solution cell (the learner's function) with the graded test
cells that follow it, up to the next solution cell; a hand-graded answer cell
is an exercise of its own.
"""

import argparse
import ast
import json
import sys
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parent.parent
INDEX = REPO / "autograder" / "exercises.json"
README = REPO / "README.md"
START, END = "<!-- exercises:start -->", "<!-- exercises:end -->"


def nbgrader_meta(cell):
    return cell.metadata.get("nbgrader", {})


def function_signature(source):
    """Name and signature of the first function a solution cell defines (None for other cells)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None, None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            if isinstance(node, ast.ClassDef):
                return node.name, f"class {node.name}"
            return node.name, f"{node.name}({ast.unparse(node.args)})"
    return None, None


def exercises_of(path):
    nb = nbformat.read(path, as_version=4)
    found, current = [], None
    for cell in nb.cells:
        meta = nbgrader_meta(cell)
        if meta.get("solution") and meta.get("grade"):  # hand-graded written answer
            found.append(dict(kind="written", solution=meta["grade_id"], tests=[meta["grade_id"]],
                              points=float(meta.get("points", 0)), function=None, signature=None))
            current = None
        elif meta.get("solution") and cell.cell_type == "code":
            name, signature = function_signature(cell.source)
            current = dict(kind="code", solution=meta["grade_id"], tests=[], points=0.0,
                           function=name, signature=signature)
            found.append(current)
        elif meta.get("grade") and cell.cell_type == "code" and current is not None:
            current["tests"].append(meta["grade_id"])
            current["points"] += float(meta.get("points", 0))
    rel = path.relative_to(REPO).as_posix()
    return [dict(assignment=path.parent.name, notebook=rel, **e) for e in found]


def build_index():
    return [e for nb in sorted((REPO / "solutions").glob("*/*.ipynb")) for e in exercises_of(nb)]


def readme_table(index):
    rows = ["| assignment | exercise | what you write | tests | points |", "|---|---|---|---|---|"]
    for e in index:
        what = f"`{e['signature']}`" if e["signature"] else "a written answer (graded by hand)"
        rows.append(f"| {e['assignment']} | {e['solution']} | {what} | {len(e['tests'])} | "
                    f"{e['points']:g} |")
    total = sum(e["points"] for e in index)
    rows.append(f"| **all** | {len(index)} exercises | | | **{total:g}** |")
    return "\n".join(rows)


def rendered():
    index = build_index()
    text = json.dumps(index, indent=2) + "\n"
    readme = README.read_text()
    if START not in readme or END not in readme:
        raise SystemExit(f"README.md lacks the {START} ... {END} markers for the exercise table")
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return text, f"{head}{START}\n{readme_table(index)}\n{END}{tail}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check that both are fresh")
    args = parser.parse_args(argv)
    index_text, readme_text = rendered()
    if args.check:
        stale = [p.name for p, text in ((INDEX, index_text), (README, readme_text))
                 if not p.exists() or p.read_text() != text]
        if stale:
            print(f"stale: {', '.join(stale)}; run `make index` (python autograder/exercises.py)")
            return 1
        return 0
    INDEX.write_text(index_text)
    README.write_text(readme_text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
