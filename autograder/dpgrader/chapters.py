"""The course's chapters by name: one name per chapter, derived in one place.

    chapter_of("10_zero_and_fsdp")     # "zero_and_fsdp"
    assignments()                      # ["00_orientation", ..., "13_gpt_in_3d", ...]: solutions/NN_<chapter>
    CHAPTERS                           # {"zero_and_fsdp": "10_zero_and_fsdp", ...}

An assignment is a folder solutions/NN_<chapter> (its notebook inside); its chapter name is the folder
without its number, and every other place of the chapter is named by it: its grader package
(autograder/dpgrader/<chapter>/), its topic package (course/dpcourse/topics/<chapter>/, where it has one),
its tests (tests/library/test_topics_<chapter>_*.py, tests/grader/test_<chapter>_*.py), its bench
(tests/bench/bench_<chapter>.py) and its pytest marker. A chapter added as a new folder (13_gpt_in_3d,
14_when_ranks_fail) is found here without a list to update. Used by autograder/exercises.py, the tests'
markers and grading helpers, and the benches.
"""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ASSIGNMENT = re.compile(r"(?P<number>\d{2})_(?P<chapter>[a-z][a-z0-9_]*)")


def chapter_of(assignment):
    """The chapter name of an assignment: its folder name without the number ("10_zero_and_fsdp" ->
    "zero_and_fsdp"). A ValueError for a name that is no assignment's."""
    match = ASSIGNMENT.fullmatch(str(assignment))
    if match is None:
        raise ValueError(f"{assignment!r} is not an assignment's name (NN_<chapter>, e.g. 10_zero_and_fsdp)")
    return match["chapter"]


def assignments(root=REPO):
    """The assignments, in course order: the folders of solutions/ named NN_<chapter> that hold a notebook."""
    folder = Path(root) / "solutions"
    return sorted(p.name for p in folder.iterdir()
                  if p.is_dir() and ASSIGNMENT.fullmatch(p.name) and any(p.glob("*.ipynb")))


def chapters(root=REPO):
    """{chapter name: assignment}, in course order."""
    return {chapter_of(a): a for a in assignments(root)}


CHAPTERS = chapters()
