"""Tests tagged by what they grade, as minitorch tags its tests by task: `pytest -m ring_all_reduce` runs
every test of that exercise and nothing else, `pytest -m ring_allreduce` every test of the chapter.

The markers are the exercise keys and the chapter names of autograder/exercises.json, registered by
tests/conftest.py (pytest runs with --strict-markers, so a misspelt key fails at collection).

    pytestmark = exercise("ring_all_reduce")                 # a whole test module
    @exercise("ring_reduce_scatter", "ring_all_gather")       # one test
"""

import json
from pathlib import Path

import pytest

from dpgrader.chapters import chapter_of

INDEX = json.loads((Path(__file__).resolve().parent.parent / "autograder" / "exercises.json").read_text())
ASSIGNMENT_OF = {e["solution"]: e["assignment"] for e in INDEX}
CHAPTERS = sorted({chapter_of(a) for a in ASSIGNMENT_OF.values()})


def register(config):
    for key, assignment in ASSIGNMENT_OF.items():
        config.addinivalue_line("markers", f"{key}: tests of the exercise {key} ({assignment})")
    for chapter in CHAPTERS:
        config.addinivalue_line("markers", f"{chapter}: tests of the chapter {chapter}")


def exercise(*keys):
    """The marks of tests about these exercises: each key, and its chapter."""
    unknown = [k for k in keys if k not in ASSIGNMENT_OF]
    if unknown:
        raise ValueError(f"no exercise {unknown} in autograder/exercises.json")
    chapters = sorted({chapter_of(ASSIGNMENT_OF[k]) for k in keys})
    return MarkList([getattr(pytest.mark, name) for name in (*keys, *chapters)])


def chapter(*names):
    """The marks of tests about whole chapters (a notebook run top to bottom)."""
    unknown = [n for n in names if n not in CHAPTERS]
    if unknown:
        raise ValueError(f"no chapter {unknown}: chapters are {CHAPTERS}")
    return MarkList([getattr(pytest.mark, name) for name in names])


class MarkList(list):
    """A list of marks that also decorates a test function (`@exercise("my_slice")`)."""

    def __call__(self, function):
        for mark in self:
            function = mark(function)
        return function


def assignment_param(assignment):
    """A test about a whole assignment (its notebook run, validated, released), tagged with its chapter."""
    return pytest.param(assignment, marks=chapter(chapter_of(assignment)), id=assignment)


def exercise_param(assignment, key):
    """One grading test per exercise; the tests of one assignment run on one xdist worker (they share
    the judge's run of the assignment: --dist loadgroup)."""
    return pytest.param(assignment, key, marks=[*exercise(key), pytest.mark.xdist_group(assignment)], id=key)
