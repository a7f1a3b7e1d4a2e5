"""hub/config/student_files.py: what the instructor's collect (and a student's fetch-feedback) copies of
another user's folder: regular files that user owns only, none through a link, whole or not at all.

Each way a student could make the instructor copy something else is a case: a symbolic link (to a file,
to a folder, the folder itself), a hard link to someone else's file, a FIFO (a copy would block on it
forever), a device, a file of someone else's. As root (the files are made with other owners)."""

import os
import stat
import sys

import pytest

from .conftest import REPO

sys.path.insert(0, str(REPO / "hub" / "config"))
import student_files  # noqa: E402

STUDENT, OTHER = 4242, 4343  # uids nobody uses: files are only made with them as owners


@pytest.fixture
def submission(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("files of other owners are made with chown: run as root (make test as root, as CI does)")
    folder = tmp_path / "inbound" / "ada+00_orientation+2026-01-01 00:00:00 UTC+abc"
    folder.mkdir(parents=True)
    (folder / "00_orientation.ipynb").write_text('{"cells": []}')
    (folder / "data").mkdir()
    (folder / "data" / "notes.txt").write_text("mine")
    for path in (folder, *folder.rglob("*")):
        os.chown(path, STUDENT, STUDENT, follow_symlinks=False)
    return folder


def own(path):
    os.chown(path, STUDENT, STUDENT, follow_symlinks=False)
    return path


def solution(tmp_path):
    secret = tmp_path / "solutions.ipynb"
    secret.write_text("### BEGIN SOLUTION")
    return secret


def test_a_submission_of_regular_files_of_its_student_is_copied_whole(submission, tmp_path):
    copied = student_files.copy_tree(submission, tmp_path / "dest", STUDENT)
    assert sorted(copied) == ["00_orientation.ipynb", os.path.join("data", "notes.txt")]
    assert (tmp_path / "dest" / "data" / "notes.txt").read_text() == "mine"
    assert student_files.problems(submission, STUDENT) == []


@pytest.mark.parametrize("attack", ["symlink_to_the_solutions", "symlink_to_a_folder", "hard_link", "fifo",
                                    "device", "someone_elses_file", "folder_is_a_symlink"])
def test_anything_but_the_students_own_regular_files_is_refused_and_nothing_copied(submission, tmp_path,
                                                                                   attack):
    notebook = submission / "00_orientation.ipynb"
    folder = submission
    if attack == "symlink_to_the_solutions":
        notebook.unlink()
        notebook.symlink_to(solution(tmp_path))
        own(notebook)
        expected = "00_orientation.ipynb is a symbolic link"
    elif attack == "symlink_to_a_folder":
        (submission / "data" / "notes.txt").unlink()
        (submission / "data").rmdir()
        (submission / "data").symlink_to(tmp_path)
        own(submission / "data")
        expected = "data is a symbolic link"
    elif attack == "hard_link":  # where protected_hardlinks is off, a student can link a file they may read
        notebook.unlink()
        theirs = solution(tmp_path)
        os.chown(theirs, OTHER, OTHER)
        os.link(theirs, notebook)
        expected = "not by the student"
    elif attack == "fifo":
        notebook.unlink()
        os.mkfifo(notebook)
        own(notebook)
        expected = "00_orientation.ipynb is a FIFO"
    elif attack == "device":
        notebook.unlink()
        os.mknod(notebook, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null's
        own(notebook)
        expected = "00_orientation.ipynb is a device"
    elif attack == "someone_elses_file":
        os.chown(notebook, OTHER, OTHER)
        expected = f"owned by uid {OTHER}"
    else:  # the submission's folder itself a link to a folder of the instructor's
        folder = submission.parent / "ada+00_orientation+2026-01-02 00:00:00 UTC+xyz"
        folder.symlink_to(tmp_path)
        own(folder)
        expected = "is a symbolic link"
    found = student_files.problems(folder, STUDENT)
    assert any(expected in problem for problem in found), found
    with pytest.raises(student_files.Refused) as refused:
        student_files.copy_tree(folder, tmp_path / "dest", STUDENT)
    assert any(expected in problem for problem in refused.value.problems), refused.value.problems
    assert not (tmp_path / "dest").exists(), "a refused submission must leave nothing behind"


def test_a_hard_link_to_the_students_own_file_elsewhere_is_refused_too(submission, tmp_path):
    kept = tmp_path / "elsewhere.ipynb"
    kept.write_text("{}")
    own(kept)
    os.link(kept, submission / "second.ipynb")
    assert any("a hard link" in p for p in student_files.problems(submission, STUDENT))


def test_a_file_swapped_for_a_link_after_the_listing_is_not_read(submission, tmp_path, monkeypatch):
    """Between listing the folder and reading a file, the student replaces it by a link: the read opens
    without following links (O_NOFOLLOW) and refuses."""
    notebook = submission / "00_orientation.ipynb"
    real_scan = student_files._scan

    def scan_then_swap(*args, **kwargs):
        scanned = real_scan(*args, **kwargs)
        notebook.unlink()
        notebook.symlink_to(solution(tmp_path))
        own(notebook)
        return scanned

    monkeypatch.setattr(student_files, "_scan", scan_then_swap)
    with pytest.raises((student_files.Refused, OSError)):
        student_files.copy_tree(submission, tmp_path / "dest", STUDENT)
    assert not (tmp_path / "dest").exists()


def test_copy_file_takes_a_regular_file_of_its_owner_through_a_folder_it_may_only_pass(submission, tmp_path):
    """fetch-feedback's source: the exchange's feedback folder is 0711 (no listing); a link or another
    owner's file there is refused, and a link at the destination is replaced, not followed."""
    feedback = tmp_path / "feedback"
    feedback.mkdir(mode=0o711)
    html = feedback / "abc.html"
    html.write_text("<html>3 / 6</html>")
    own(html)
    target = tmp_path / "mine.html"
    victim = tmp_path / "victim.txt"
    victim.write_text("untouched")
    target.symlink_to(victim)
    student_files.copy_file(html, target, STUDENT)
    assert not target.is_symlink() and target.read_text() == "<html>3 / 6</html>"
    assert victim.read_text() == "untouched"
    (feedback / "link.html").symlink_to(solution(tmp_path))
    with pytest.raises((student_files.Refused, OSError)):
        student_files.copy_file(feedback / "link.html", tmp_path / "other.html", STUDENT)
    os.chown(html, OTHER, OTHER)
    with pytest.raises(student_files.Refused):
        student_files.copy_file(html, tmp_path / "other.html", STUDENT)
