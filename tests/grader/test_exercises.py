"""autograder/exercises.json: every exercise has what docs/authoring.md asks of it, found by its key."""

import json

from conftest import REPO

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
        home = REPO / "autograder" / "dpgrader" / assignment.split("_", 1)[1]
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
