"""Grade notebooks in tests: the solution, the released version and planted-bug variants.

A variant is the released notebook with some solution cells replaced by buggy code: the planted
bugs of a chapter live beside its hidden checks, in autograder/dpgrader/<chapter>/bugs.py, and what
grading gave is recorded there too (expected_grades.json).
"""

import importlib
import json
import os
import re
import subprocess
import sys

import nbformat

from conftest import REPO
from dpgrader.chapters import assignments, chapter_of

ASSIGNMENTS = assignments()
DPGRADER = REPO / "autograder" / "dpgrader"
# Parts of a message that change from run to run, and what they are compared as
VOLATILE = [
    (re.compile(r"\d+(\.\d+)? ms\b"), "<t> ms"),
    (re.compile(r"took \d+(\.\d+)? s\b"), "took <t> s"),
    (re.compile(r"(/var)?/tmp/[^\s'\"),]+"), "<tmp>"),
    (re.compile(r"\bpid \d+"), "pid <n>"),
    # memory measured from outside a rank (topics/*/measured.py): a few hundred KiB from run to run
    (re.compile(r"\bheld \d+(\.\d+)? MiB more than"), "held <m> MiB more than"),
    (re.compile(r"\b\d+(\.\d+)? MiB more than that"), "<m> MiB more than that"),
    # which rank's failure the launcher saw first (the others are listed after it)
    (re.compile(r"\brank \d+ of (\d+) (raised|was killed|gave up)"), r"rank <r> of \1 \2"),
    (re.compile(r"\(so did ranks? [\d, and]+\)"), "(so did <ranks>)"),
    # when every rank raised, which one the launcher saw first varies, and with it where the message
    # says it raised
    # (the first "on rank N" only, already normalised or not: normalising twice changes nothing)
    (re.compile(r"^(LaunchError: rank <r> of .*?)\bon rank (?:\d+|<r>)(, stage (?:\d+|<s>))?"),
     lambda m: m.group(1) + "on rank <r>" + (", stage <s>" if m.group(2) else "")),
]
# What the table does not compare even in stable cells: whether the other ranks had failed the same way
# before the launcher stopped them ("(so did ...)"), and the line of a loop at which a spinning rank
# was caught.
LOOSE = [(re.compile(r" \(so did <ranks>\)"), ""), (re.compile(r"(<cell \d+>):\d+"), r"\1:<line>")]
# Numbers are compared to 6 significant digits: a sum taken in another order (threads, a loaded
# machine) changes a float's last bits, never what the message says.
NUMBER = re.compile(r"(?<![\w.])-?\d+\.\d+(?:e[-+]?\d+)?(?![\w.])")


def comparable(value):
    if not isinstance(value, str):
        return value
    for pattern, replacement in VOLATILE + LOOSE:
        value = pattern.sub(replacement, value)
    return NUMBER.sub(lambda m: f"{float(m.group()):.6g}", value)


# Cells of planted bugs that are races themselves (threads finishing in any order, a gradient read while
# its all-reduce may or may not be done, several ranks failing at once): what they show changes from run
# to run, so the table is not compared on them ("message": the first line only; "result": points too).
# The bug's `loses` pins what is certain.
FINISHING_ORDER = ("02_dataparallel", "drops_non_tensors_and_gathers_in_finishing_order")
NEVER_WAITS = ("05_ddp_from_scratch", "no_buffers__same_data__bias_skipped__never_waits")
UNSTABLE = {
    (*FINISHING_ORDER, "test_mini_data_parallel_basic"): "result",
    (*FINISHING_ORDER, "test_mini_data_parallel_edge_cases"): "message",
    (*NEVER_WAITS, "test_bucketed_ddp_basic"): "result",
    # every rank's receive is refused; which refusal the launcher reports first varies
    ("04_ring_allreduce", "wrong_peer_broadcast_default_group_bypass", "test_ring_reduce_scatter_edge_cases"):
        "message",
    # both stages run out of micro-batches (split(m) gives fewer than m) at once; which one is named varies
    ("07_pipeline_parallelism", "split_instead_of_tensor_split", "test_gpipe_step_basic"): "message",
    # both ranks' backward returns a gradient of the wrong shape at once; which one the launcher names varies
    ("08_tensor_parallelism", "gather_backward_returns_the_whole_gradient", "test_gather_from_tp_basic"):
        "message",
    # rank 2 sleeps, ranks 0 and 1 do not: which of the two is faster (the one this bug names) varies
    ("14_when_ranks_fail", "the_fastest_rank_named", "test_straggler_report_basic"): "message",
}


def notebook_name(assignment):
    return next((REPO / "solutions" / assignment).glob("*.ipynb")).name


def solution_path(assignment):
    return REPO / "solutions" / assignment / notebook_name(assignment)


def released_path(assignment):
    return REPO / "course" / assignment / notebook_name(assignment)


def expected_grades_path(assignment):
    """What grading gave, recorded: per graded notebook, per cell (record_grades.py writes it)."""
    return DPGRADER / chapter_of(assignment) / "expected_grades.json"


def expected_grades(assignment):
    """The recorded table of an assignment, or None when it has none (test_grading then fails)."""
    path = expected_grades_path(assignment)
    return json.loads(path.read_text()) if path.exists() else None


def exercise_tests(assignment):
    """{exercise key: its graded test cells} of an assignment's code exercises (autograder/exercises.json)."""
    index = json.loads((REPO / "autograder" / "exercises.json").read_text())
    return {e["solution"]: e["tests"] for e in index if e["assignment"] == assignment and e["kind"] == "code"}


def variants_of(assignment):
    """The graded variants of an assignment: {name: {"cells": {grade_id: source}, "loses", "keeps"}}.

    The chapter's bugs module (dpgrader.<chapter>.bugs) holds BUGS, a list of planted.Bug (edits of
    the solution) and planted.Variant (several bugs graded in one notebook).
    """
    module = importlib.import_module(f"dpgrader.{chapter_of(assignment)}.bugs")
    names = [bug.name for bug in module.BUGS]
    names += [inner.name for bug in module.BUGS for inner in getattr(bug, "bugs", [])]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    assert not duplicates, f"planted bugs of {assignment} share names: {duplicates}"
    return {bug.name: {"cells": bug.cell_sources(assignment), "loses": bug.loses, "keeps": bug.keeps,
                       "exercise": bug.exercise, "exercises": getattr(bug, "exercises", [bug.exercise])}
            for bug in module.BUGS}


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


def first_line(message):
    """The first line of a grading message, with timings, pids and temporary paths normalised."""
    line = (message or "").strip().splitlines()[0] if (message or "").strip() else ""
    for pattern, replacement in VOLATILE:
        line = pattern.sub(replacement, line)
    return line


def table_of(graded):
    """{notebook name: {grade_id: {points, max_points, message}}}: what expected_grades.json holds."""
    return {name: {c["grade_id"]: {"points": c["points"], "max_points": c["max_points"],
                                   "message": first_line(c["message"])} for c in result["cells"]}
            for name, result in graded.items()}


def differences(graded, expected, assignment=None, cells=None):
    """How a grading run differs from the recorded table: a list of sentences (empty if it does not).

    Written answers are left out (graded by hand). The judge grades a planted bug only on the
    cells it lists (loses and keeps), so a variant is compared on the cells it was graded on; the
    solution and the released notebook on all of theirs. `cells`: compare these grade ids only (one
    exercise's). UNSTABLE cells are compared on less.
    """
    got, problems = table_of(graded), []
    if cells is None:
        for name in sorted(set(expected) - set(got)):
            problems.append(f"{name}: recorded in expected_grades.json but not graded (renamed or removed?)")
    for name in sorted(set(got) - set(expected)):
        problems.append(f"{name}: graded but not recorded in expected_grades.json (record it: "
                        f"tests/grader/record_grades.py)")
    manual = {c["grade_id"] for result in graded.values() for c in result["cells"] if c["manual"]}

    def compared(row):
        return {k: v for k, v in row.items() if k not in manual and (cells is None or k in cells)}

    for name in sorted(set(got) & set(expected)):
        mine, want = compared(got[name]), compared(expected[name])
        unrecorded = set(mine) - set(want)
        ungraded = set(want) - set(mine) if name in ("solution", "released") else set()
        if unrecorded or ungraded:
            problems.append(f"{name}: graded cells {sorted(mine)}, recorded {sorted(want)}")
        for grade_id in sorted(set(mine) & set(want)):
            unstable = UNSTABLE.get((assignment, name, grade_id))
            fields = {None: ("points", "max_points", "message"), "message": ("points", "max_points"),
                      "result": ("max_points",)}[unstable]
            for field in fields:
                if comparable(mine[grade_id][field]) != comparable(want[grade_id][field]):
                    problems.append(f"{name}, {grade_id}: {field} {mine[grade_id][field]!r}, recorded "
                                    f"{want[grade_id][field]!r}")
    return problems
