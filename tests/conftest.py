"""Shared test helpers: the process table, paths of the repository, and the markers by exercise."""

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# The grading helpers (grading.py, judging.py) serve tests in several folders.
sys.path.insert(0, str(REPO / "tests" / "grader"))


def pytest_configure(config):
    from markers import register

    register(config)


def children_of(pid):
    """Pids whose parent is `pid`, read from the process table (/proc), zombies included."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                kids.append(int(entry))
    return kids


def descendants_of(pid):
    """Every live process below `pid` (children, their children, ...), zombies excluded."""
    found, todo = [], children_of(pid)
    while todo:
        child = todo.pop()
        if is_running(child):
            found.append(child)
        todo += children_of(child)
    return found


def is_running(pid):
    """True if pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def no_orphans():
    """Fail the test if it leaves any child process of the test process behind."""
    before = set(children_of(os.getpid()))
    yield
    left = set(children_of(os.getpid())) - before
    assert not left, f"processes left behind by the launcher: {sorted(left)}"
