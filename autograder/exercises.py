"""The exercise index: generated from solutions/, written to exercises.json and the README table.

    python autograder/exercises.py          # rewrite autograder/exercises.json and README.md's table
    python autograder/exercises.py --check  # exit 1 if either is stale (the tests run this)

An exercise is a solution cell (the learner's function) with the graded test
cells that follow it, up to the next solution cell; a hand-graded answer cell
is an exercise of its own. Its key is the solution cell's grade id, and everything
about it is found by that key, in three places (docs/authoring.md): its notebook in solutions/,
its chapter's grader package autograder/dpgrader/<chapter>/, and the dpcourse topics it uses:

  tests            the graded test cells that follow it (test_<key>_<what>)
  grader           autograder/dpgrader/<chapter>/, which holds everything below but the helpers
  hidden_checks    the functions its test cells' hidden sections call (checks.py: check_<key>...)
  planted_bugs     the Bug("<key>", "<name>", ...) entries of bugs.py
  reference        what its expected values come from: REFERENCES["<key>"] in checks.py
  tuned            the instructor's tuned version the benchmarks race: TUNED["<key>"] in tuned.py
  expected_grades  what grading gave, recorded (expected_grades.json; tests/grader/record_grades.py)
  helpers          the dpcourse modules its test cells use (its checks, in dpcourse.topics.<topic>)
  demos            the dpcourse modules the demo cells after it use (its widgets and pictures)

All of it is read from the files as text (ast), nothing is imported: the index needs no torch.

    python autograder/exercises.py --files ring_all_reduce   # every file that holds a part of it

`files_of(key)` answers that from the index and the files: its notebook (solution and released), its
chapter's grader files, the dpcourse modules its test cells, demos and hidden checks use, and the test
files whose markers name it (tests/markers.py: `exercise("<key>")`) or that grade it.
"""

import argparse
import ast
import importlib.util
import json
import re
import sys
from pathlib import Path

import nbformat

from dpgrader.chapters import chapter_of

REPO = Path(__file__).resolve().parent.parent
INDEX = REPO / "autograder" / "exercises.json"
AUTOGRADER = REPO / "autograder"
DPGRADER = AUTOGRADER / "dpgrader"
DPCOURSE_INIT = REPO / "course" / "dpcourse" / "__init__.py"
HIDDEN = re.compile(r"### BEGIN HIDDEN TESTS\n(.*?)### END HIDDEN TESTS", re.S)
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
    imports = imported_names(cell.source for cell in nb.cells if cell.cell_type == "code")
    for cell in nb.cells:
        meta = nbgrader_meta(cell)
        if meta.get("solution") and meta.get("grade"):  # hand-graded written answer
            found.append(dict(kind="written", solution=meta["grade_id"], tests=[meta["grade_id"]],
                              points=float(meta.get("points", 0)), function=None, signature=None,
                              sources=[], demo_sources=[]))
            current = None
        elif meta.get("solution") and cell.cell_type == "code":
            name, signature = function_signature(cell.source)
            current = dict(kind="code", solution=meta["grade_id"], tests=[], points=0.0,
                           function=name, signature=signature, sources=[], demo_sources=[])
            found.append(current)
        elif meta.get("grade") and cell.cell_type == "code" and current is not None:
            current["tests"].append(meta["grade_id"])
            current["points"] += float(meta.get("points", 0))
            current["sources"].append(cell.source)
        elif "demo" in cell.metadata.get("tags", []) and current is not None:
            current["demo_sources"].append(cell.source)
    rel = path.relative_to(REPO).as_posix()
    assignment = path.parent.name
    chapter = chapter_of(assignment)
    grader = DPGRADER / chapter
    bugs, refs, tuned = planted_bugs(assignment), references(), tuned_versions(chapter)
    out = []
    for e in found:
        sources, demos = e.pop("sources"), e.pop("demo_sources")
        key = e["solution"]
        out.append(dict(assignment=assignment, notebook=rel, **e,
                        grader=grader.relative_to(REPO).as_posix() + "/",
                        hidden_checks=hidden_checks(sources), planted_bugs=bugs.get(key, []),
                        reference=refs.get(key), tuned=tuned.get(key),
                        expected_grades=(grader / "expected_grades.json").relative_to(REPO).as_posix(),
                        helpers=helper_modules(sources, imports), demos=helper_modules(demos, imports)))
    return out


def hidden_checks(sources):
    """'dpgrader.<module>.<function>' of every function the hidden sections of these cells call."""
    found = []
    for source in sources:
        for hidden in HIDDEN.findall(source):
            tree = ast.parse(hidden)
            modules = {alias.asname or alias.name: node.module for node in ast.walk(tree)
                       if isinstance(node, ast.ImportFrom) for alias in node.names}
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                    name = node.func.id
                    if name in modules and f"{modules[name]}.{name}" not in found:
                        found.append(f"{modules[name]}.{name}")
    return found


def imported_names(sources):
    """{name: the dpcourse module it comes from} for every `from dpcourse... import` in these sources."""
    top = {alias.asname or alias.name: node.module for node in ast.parse(DPCOURSE_INIT.read_text()).body
           if isinstance(node, ast.ImportFrom) for alias in node.names}
    names = {}
    for source in sources:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "dpcourse":
                for alias in node.names:
                    module = top.get(alias.name, node.module) if node.module == "dpcourse" else node.module
                    names[alias.asname or alias.name] = module
    return names


def helper_modules(sources, imports):
    """The dpcourse modules whose names these cells use (wherever in the notebook they are imported)."""
    modules = set()
    for source in sources:
        try:
            tree = ast.parse(source)
        except SyntaxError:  # a demo cell with a magic
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id in imports:
                modules.add(imports[node.id])
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dpcourse."):
                modules.add(node.module)
    return sorted(modules)


def literal_table(path, name):
    """The dict literal assigned to `name` at the top of a module (read, not imported), or {}."""
    if not path.exists():
        return {}
    for node in ast.parse(path.read_text()).body:
        targets = [getattr(t, "id", None) for t in getattr(node, "targets", [])]
        if isinstance(node, ast.Assign) and name in targets:
            return ast.literal_eval(node.value)
    return {}


def references():
    """{exercise key: where its expected values come from}: the REFERENCES dicts of the chapters' checks."""
    found = {}
    for path in sorted(DPGRADER.glob("*/checks.py")):
        found.update(literal_table(path, "REFERENCES"))
    return found


def tuned_versions(chapter):
    """{exercise key: 'dpgrader.<chapter>.tuned.<name>'} from the TUNED table of the chapter's tuned.py."""
    return {key: f"dpgrader.{chapter}.tuned.{name}"
            for key, name in literal_table(DPGRADER / chapter / "tuned.py", "TUNED").items()}


def planted_bugs(assignment):
    """{exercise key: [bug names]} from the BUGS list of the chapter's bugs.py.

    The module is imported (as the grading test does), so bugs built by helper functions count too.
    """
    path = DPGRADER / chapter_of(assignment) / "bugs.py"
    if not path.exists():
        return {}
    sys.path.insert(0, str(AUTOGRADER))
    try:
        spec = importlib.util.spec_from_file_location(f"bugs_{assignment}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(AUTOGRADER))
    bugs = {}
    for bug in getattr(module, "BUGS", []):
        for inner in getattr(bug, "bugs", [bug]):
            if inner.exercise is not None:
                bugs.setdefault(inner.exercise, []).append(inner.name)
    return bugs


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


MARKED = re.compile(r"exercise(?:_param)?\(([^)]*)\)")


def _module_file(module):
    """The source file of a dpcourse or dpgrader module, or None."""
    parts = module.split(".")
    base = REPO / "course" if parts[0] == "dpcourse" else AUTOGRADER
    for candidate in (base.joinpath(*parts).with_suffix(".py"), base.joinpath(*parts, "__init__.py")):
        if candidate.exists():
            return candidate
    return None


def _imported_modules(path):
    """The dpcourse and dpgrader modules a source file imports (read, not imported)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("dpcourse", "dpgrader"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] in ("dpcourse", "dpgrader")}
    return found


def marked_tests(key):
    """Test files whose markers name the exercise (`exercise("<key>", ...)`), and the grading test."""
    found = [REPO / "tests" / "grader" / "test_grading.py"]  # grades every exercise (exercise_param)
    for path in sorted((REPO / "tests").rglob("*.py")):
        if path.name == "markers.py" or path in found:
            continue
        text = path.read_text(errors="replace")
        if any(re.search(rf"[\"']{re.escape(key)}[\"']", args) for args in MARKED.findall(text)):
            found.append(path)
    return found


def files_of(key, index=None):
    """Every file that holds a part of exercise `key`, relative to the repository: {what: [paths]}."""
    index = index or json.loads(INDEX.read_text())
    entry = next((e for e in index if e["solution"] == key), None)
    if entry is None:
        raise KeyError(f"no exercise {key!r} in {INDEX.relative_to(REPO)}")
    notebook = REPO / entry["notebook"]
    grader = REPO / entry["grader"]
    checks = sorted({_module_file(c.rsplit(".", 1)[0]) for c in entry.get("hidden_checks") or []} - {None})
    behind_checks = {m for path in checks for m in _imported_modules(path) if m.startswith("dpcourse.")}
    modules = sorted(set(entry.get("helpers") or []) | set(entry.get("demos") or []) | behind_checks)
    files = {
        "notebook": [notebook, REPO / "course" / notebook.parent.name / notebook.name],
        "grader": [grader / name for name in ("checks.py", "bugs.py", "expected_grades.json", "tuned.py")
                   if (grader / name).exists() and (name != "tuned.py" or entry.get("tuned"))],
        "hidden checks": checks,
        "dpcourse": [f for f in map(_module_file, modules) if f is not None],
        "tests": marked_tests(key),
    }
    return {what: [str(Path(p).relative_to(REPO)) for p in paths] for what, paths in files.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check that both are fresh")
    parser.add_argument("--files", metavar="KEY", help="list every file that holds a part of exercise KEY")
    args = parser.parse_args(argv)
    if args.files:
        for what, paths in files_of(args.files).items():
            print(f"{what}:" + "".join(f"\n  {p}" for p in paths))
        return 0
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
