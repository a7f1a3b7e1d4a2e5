"""autograder/exercises.json: every exercise has what docs/authoring.md asks of it, found by its key."""

import json
import os
import subprocess
import sys

from conftest import REPO
from dpgrader.chapters import chapter_of

INDEX = json.loads((REPO / "autograder" / "exercises.json").read_text())
CODE = [e for e in INDEX if e["kind"] == "code"]


def lacking(field):
    return [f"{e['assignment']}/{e['solution']}: no {field.replace('_', ' ')}" for e in CODE if not e[field]]


def test_every_exercise_has_hidden_checks_and_a_reference():
    missing = lacking("hidden_checks") + lacking("reference")
    assert not missing, "\n".join(missing) + "\n(see docs/authoring.md; then `make index`)"


def test_every_exercise_has_planted_bugs():
    few = [f"{e['assignment']}/{e['solution']}: {len(e['planted_bugs'])} planted bug(s)" for e in CODE
           if len(e["planted_bugs"]) < 4]
    assert not few, "\n".join(few) + "\n(docs/authoring.md asks for at least four per exercise)"


def test_tests_and_hidden_checks_are_named_by_the_exercise_key():
    wrong = []
    for e in CODE:
        key = e["solution"]
        wrong += [f"{e['assignment']}: test cell {t} of {key} is not test_{key}_<what>" for t in e["tests"]
                  if not t.startswith(f"test_{key}_")]
        wrong += [f"{e['assignment']}: hidden check {c} of {key} is not check_{key}[_<what>]"
                  for c in e["hidden_checks"] if not c.rsplit(".", 1)[1].startswith(f"check_{key}")]
    assert not wrong, "\n".join(wrong)


def test_keys_are_unique_and_snake_case():
    keys = [e["solution"] for e in INDEX]
    assert len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)
    assert all(k == k.lower() and k.isidentifier() for k in keys), keys


def test_each_chapter_keeps_its_grader_side_in_one_package():
    """checks, planted bugs and recorded grades of every chapter in autograder/dpgrader/<chapter>/."""
    missing = []
    for assignment in sorted({e["assignment"] for e in INDEX}):
        home = REPO / "autograder" / "dpgrader" / chapter_of(assignment)
        missing += [f"{home.relative_to(REPO)}/{name}" for name in ("checks.py", "bugs.py",
                                                                     "expected_grades.json")
                    if not (home / name).exists()]
    assert not missing, f"missing: {missing} (docs/authoring.md, 'Where things live')"


def test_every_tuned_version_named_in_the_index_exists():
    import importlib

    wrong = []
    for e in CODE:
        if e["tuned"]:
            module, name = e["tuned"].rsplit(".", 1)
            if not hasattr(importlib.import_module(module), name):
                wrong.append(f"{e['solution']}: {e['tuned']} does not exist")
    assert not wrong, "\n".join(wrong)


# Code exercises whose key selects nothing but their grading test (test_grading.py's
# test_exercise_graded[<key>]), each with why: the list is reviewed, and shrinks as their tests come.
ONLY_GRADED = {
    "ring_shift": "its checks (topics.collectives.checks.expect_from, expect_new_tensor, "
                  "expect_unchanged) have no library test",
    "naive_all_reduce": "expect_same_bits has no library test; the bench's naive all-reduce "
                        "(ring_allreduce/tuned.py) is a grader-side rewrite, not this exercise's code",
    "p2p_broadcast": "its checks (expect_from, comm.traffic.expect_tree_messages) have no library test",
    "p2p_all_gather": "its check (topics.collectives.checks.expect_gathered) has no library test",
    "broadcast_model": "its test cells use only shared checks (checks.params.expect_same_state) and toys",
}

# A pytest plugin for the collection below: every collected test's marker names, as JSON.
COLLECTED_MARKERS = '''
import json
import os


def pytest_collection_finish(session):
    marks = {item.nodeid: sorted({mark.name for mark in item.iter_markers()}) for item in session.items}
    with open(os.environ["DPCOURSE_COLLECTED_MARKERS"], "w") as f:
        json.dump(marks, f)
'''


def collected_markers(folder):
    """{test id: its marker names} of every test `pytest` collects (in a separate pytest, collection only)."""
    (folder / "collected_markers.py").write_text(COLLECTED_MARKERS)
    out = folder / "markers.json"
    env = dict(os.environ, DPCOURSE_COLLECTED_MARKERS=str(out),
               PYTHONPATH=os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-p", "collected_markers"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"collecting the tests failed:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}"
    return json.loads(out.read_text())


def test_every_code_exercise_selects_tests_besides_its_grading(tmp_path):
    """`pytest -m <key>` runs an exercise's grading and the tests of its checks, reference, tuned version and
    widgets (tests/markers.py); a code exercise whose key finds only its grading test is listed above."""
    marks = collected_markers(tmp_path)
    keys = [e["solution"] for e in CODE]
    grading = {key: f"tests/grader/test_grading.py::test_exercise_graded[{key}]" for key in keys}
    ungraded = [key for key in keys if key not in marks.get(grading[key], [])]
    assert not ungraded, f"no grading test tagged with these keys: {ungraded}"
    others = {key: [test for test, names in marks.items() if key in names and test != grading[key]]
              for key in keys}
    lacking = [key for key in keys if not others[key] and key not in ONLY_GRADED]
    assert not lacking, (f"`pytest -m <key>` finds only the grading test of {lacking}: tag the tests of "
                         f"their checks, reference, tuned version and widgets with `exercise(...)` "
                         f"(tests/markers.py), or list them in ONLY_GRADED with why")
    stale = {key: others[key][:3] for key in ONLY_GRADED if others.get(key)}
    assert not stale, f"ONLY_GRADED lists exercises whose key selects more than their grading test: {stale}"
    unknown = sorted(set(ONLY_GRADED) - set(keys))
    assert not unknown, f"ONLY_GRADED names no code exercise of autograder/exercises.json: {unknown}"


def test_a_maintainer_finds_every_file_of_an_exercise_by_its_key():
    """`python autograder/exercises.py --files <key>` (exercises.files_of): for every code exercise, its two
    notebooks, its chapter's checks and bugs, the dpcourse modules it uses and its tests, all existing."""
    sys.path.insert(0, str(REPO / "autograder"))
    from exercises import files_of

    problems = []
    for e in CODE:
        key, grader = e["solution"], e["grader"]
        files = files_of(key, INDEX)
        listed = [p for paths in files.values() for p in paths]
        problems += [f"{key}: {p} is listed but does not exist" for p in listed if not (REPO / p).exists()]
        wanted = [e["notebook"], f"course/{e['notebook'].split('/', 1)[1]}", f"{grader}checks.py",
                  f"{grader}bugs.py", "tests/grader/test_grading.py"]
        problems += [f"{key}: {p} is not listed" for p in wanted if p not in listed]
        if not files["dpcourse"]:
            problems.append(f"{key}: no dpcourse module listed")
    # a known case, by hand: the ring's library tests and its widget's browser test
    ring = files_of("ring_all_reduce", INDEX)["tests"]
    problems += [f"ring_all_reduce: {p} is not listed" for p in ("tests/library/test_topics_ringtrace.py",
                 "tests/grader/test_tuned_ring.py") if p not in ring]
    assert not problems, "\n".join(problems)
