"""dpgrader.safe_copy: a student's files are taken as regular files only, never through a link.

What a copy of a submission must refuse (the grader-trust issue, round three): a symbolic link (to
solutions/, to a classmate's work), a hard link, a FIFO (which would block the copy), a socket, a
device, a file of another owner, a file too large; a link swapped in while the folder is walked. The
student's other files are copied all the same.
"""

import os
import socket
import stat

import pytest

from dpgrader import safe_copy
from dpgrader.safe_copy import copy_regular_file, copy_regular_files


def student_folder(tmp_path):
    """submitted/bob/04 with a real notebook, a real data file in a subfolder, and every kind of trick."""
    base = tmp_path / "submitted"
    folder = base / "bob" / "04"
    (folder / "data").mkdir(parents=True)
    (folder / "04.ipynb").write_text("bob's own work")
    (folder / "data" / "x.csv").write_text("1,2")
    secret = tmp_path / "solutions.ipynb"
    secret.write_text("BEGIN SOLUTION")
    (folder / "linked.ipynb").symlink_to(secret)
    (folder / "linked_folder").symlink_to(tmp_path)
    classmate = tmp_path / "alice.ipynb"
    classmate.write_text("alice's work")
    os.link(classmate, folder / "hard.ipynb")
    os.mkfifo(folder / "pipe")
    listening = socket.socket(socket.AF_UNIX)
    listening.bind(str(folder / "sock"))
    return base, folder, listening


def test_only_regular_files_are_taken_and_the_rest_is_kept(tmp_path):
    base, _, listening = student_folder(tmp_path)
    try:
        taken = copy_regular_files(base, "bob/04", tmp_path / "copy")
    finally:
        listening.close()
    assert sorted(taken.files) == ["04.ipynb", "data/x.csv"], taken
    why = dict(taken.refused)
    assert why["linked.ipynb"] == "a symbolic link" and why["linked_folder"] == "a symbolic link", why
    assert why["hard.ipynb"].startswith("a hard link") and why["pipe"] == "a FIFO", why
    assert why["sock"] == "a socket", why
    copy = tmp_path / "copy"
    assert (copy / "04.ipynb").read_text() == "bob's own work"
    assert (copy / "data" / "x.csv").read_text() == "1,2"
    assert sorted(p.name for p in copy.iterdir()) == ["04.ipynb", "data"]
    for path in copy.rglob("*"):
        assert not path.is_symlink() and (path.is_dir() or path.stat().st_nlink == 1)
        assert path.is_dir() or stat.S_IMODE(path.stat().st_mode) == 0o644
    lines = taken.lines("bob/04")
    assert any(line.startswith("bob/04/linked.ipynb: refused (a symbolic link") for line in lines), lines


def test_a_folder_that_is_a_link_is_refused_at_any_depth_below_the_trusted_base(tmp_path):
    base = tmp_path / "submitted"
    (base / "bob").mkdir(parents=True)
    elsewhere = tmp_path / "solutions" / "04"
    elsewhere.mkdir(parents=True)
    (elsewhere / "04.ipynb").write_text("BEGIN SOLUTION")
    (base / "bob" / "04").symlink_to(elsewhere)
    with pytest.raises(OSError) as error:
        copy_regular_files(base, "bob/04", tmp_path / "copy")
    assert error.value.errno == 40  # ELOOP: the link was not followed
    (base / "carol").symlink_to(base / "bob")
    with pytest.raises(OSError):
        copy_regular_files(base, "carol/04", tmp_path / "copy2")


def test_a_link_swapped_in_after_the_listing_is_not_followed(tmp_path, monkeypatch):
    """The entry is judged on what was opened (O_NOFOLLOW, then fstat), never on a second look by name:
    a regular file listed, then replaced by a link before it is opened, is refused."""
    base = tmp_path / "submitted"
    folder = base / "bob" / "04"
    folder.mkdir(parents=True)
    (folder / "04.ipynb").write_text("bob's own work")
    secret = tmp_path / "solutions.ipynb"
    secret.write_text("BEGIN SOLUTION")
    real_open = safe_copy._open_entry

    def swap_then_open(name, dir_fd, folder_=False):
        os.unlink(name, dir_fd=dir_fd)
        os.symlink(secret, name, dir_fd=dir_fd)
        return real_open(name, dir_fd, folder_)

    monkeypatch.setattr(safe_copy, "_open_entry", swap_then_open)
    taken = copy_regular_files(base, "bob/04", tmp_path / "copy")
    assert taken.files == [] and taken.refused == [("04.ipynb", "a symbolic link")], taken
    assert not (tmp_path / "copy" / "04.ipynb").exists()


def test_owner_size_and_count_limits(tmp_path):
    base = tmp_path / "submitted"
    folder = base / "bob" / "04"
    folder.mkdir(parents=True)
    (folder / "big.bin").write_bytes(b"x" * 2000)
    for i in range(5):
        (folder / f"f{i}").write_text("ok")
    taken = copy_regular_files(base, "bob/04", tmp_path / "copy", max_bytes=1000, max_files=4)
    why = dict(taken.refused)
    assert "more than the 1000" in why["big.bin"], why
    assert len(taken.files) == 3 and "one file too many" in why["f4"], taken
    mine = os.getuid()
    taken = copy_regular_files(base, "bob/04", tmp_path / "copy3", owner=mine + 1)
    assert taken.refused == [(".", f"owned by user id {mine}, not by the student (user id {mine + 1})")]


@pytest.mark.skipif(os.geteuid() != 0, reason="making a device node and giving a file away need root")
def test_a_device_and_a_file_of_another_owner_are_refused(tmp_path):
    base = tmp_path / "submitted"
    folder = base / "bob" / "04"
    folder.mkdir(parents=True)
    os.mknod(folder / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    (folder / "theirs.ipynb").write_text("someone else's")
    os.chown(folder / "theirs.ipynb", 12345, 12345)
    (folder / "mine.ipynb").write_text("mine")
    taken = copy_regular_files(base, "bob/04", tmp_path / "copy", owner=0)
    why = dict(taken.refused)
    assert why["null"] == "a character device" and "owned by user id 12345" in why["theirs.ipynb"], why
    assert taken.files == ["mine.ipynb"]


def test_one_file_is_copied_only_when_it_is_a_regular_file(tmp_path):
    real = tmp_path / "nb.ipynb"
    real.write_text("{}")
    (tmp_path / "link.ipynb").symlink_to(real)
    os.mkfifo(tmp_path / "fifo.ipynb")
    assert copy_regular_file(real, tmp_path / "copy.ipynb") is None
    assert (tmp_path / "copy.ipynb").read_text() == "{}"
    assert copy_regular_file(tmp_path / "link.ipynb", tmp_path / "c2.ipynb") == "a symbolic link"
    assert copy_regular_file(tmp_path / "fifo.ipynb", tmp_path / "c3.ipynb") == "a FIFO"  # did not block
    assert copy_regular_file(tmp_path / "missing.ipynb", tmp_path / "c4.ipynb") == "no such file"
    assert not (tmp_path / "c2.ipynb").exists() and not (tmp_path / "c3.ipynb").exists()
