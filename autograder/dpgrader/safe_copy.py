"""Copy a student's files without trusting what they are: regular files only, opened without following links.

    from dpgrader.safe_copy import copy_regular_files, copy_regular_file

    taken = copy_regular_files(submitted, "bob/04_ring_allreduce", into, owner=uid)
    taken.files       # ["04_ring_allreduce.ipynb", "data/x.csv"]: copied, relative to the folder
    taken.refused     # [("link.ipynb", "a symbolic link")]: left out, each with why
    copy_regular_file("/home/ada/00_orientation.ipynb", into / "00_orientation.ipynb")   # one file

Why: whoever copies a submission runs with rights the student lacks (the instructor's `make
autograde` reads `autograder/submitted/`, the hub's collect reads the exchange). A symbolic link
there to `solutions/...` or to a classmate's work would be copied as the student's own: graded, and
shown back in their feedback. So every step that takes a student's files takes them through here:

- every folder is opened relative to the one above it (`openat`, `O_NOFOLLOW | O_DIRECTORY`): no
  component of the path below `base` may be a link, and nothing swapped in while walking is followed;
- every file is opened `O_NOFOLLOW | O_NONBLOCK` (a FIFO put in its place cannot block the copy) and
  judged on what was opened (`fstat` of the open file, never a second lookup of its name): a regular
  file with one link (a hard link may be someone else's file), owned by `owner` when one is given
  (where ownership means something: the student's own folder in the exchange), of at most `max_bytes`;
- anything else (a symbolic link, a hard link, a FIFO, a socket, a device, a file of another owner,
  too large, too many, too deep, unreadable) is refused with a reason for the instructor, and the
  student's other files are still copied.

The target is written as fresh files (`O_CREAT | O_EXCL | O_NOFOLLOW`) with mode 0644: no link, no
executable or set-uid bit comes through.
"""

import errno
import os
import stat
from dataclasses import dataclass, field

MAX_BYTES = 100 * 1000 * 1000  # per file (nbgrader's own collect skips files over 100,000 kB)
MAX_FILES = 1000  # per copied folder, folders included
MAX_DEPTH = 8  # folders below the copied one
CHUNK = 1 << 20


@dataclass
class Taken:
    """What copy_regular_files took: `files` (relative paths, copied) and `refused` ((relative path, why))."""

    files: list = field(default_factory=list)
    refused: list = field(default_factory=list)

    def lines(self, where=""):
        """One line per refusal, for the instructor: "bob/04/link.ipynb: refused (a symbolic link ...)"."""
        prefix = f"{where}/" if where else ""
        return [f"{prefix}{path}: refused ({why}; only regular files the student owns are taken)"
                for path, why in self.refused]


def _kind(mode):
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "not a regular file"


def _refusal(error):
    """Why opening an entry without following links failed."""
    if error.errno == errno.ELOOP:
        return "a symbolic link"
    if error.errno in (errno.ENOTDIR,):
        return "not a folder"
    if error.errno in (errno.EACCES, errno.EPERM):
        return "not readable"
    if error.errno == errno.ENXIO:
        return "a socket or device"
    return f"could not be opened ({os.strerror(error.errno)})"


def _judge_opened(info, owner, max_bytes, folder=False):
    """Why an opened entry is refused (None: it is taken), from fstat of what was opened."""
    if folder:
        if not stat.S_ISDIR(info.st_mode):
            return _kind(info.st_mode)
    elif not stat.S_ISREG(info.st_mode):
        return _kind(info.st_mode)
    elif info.st_nlink != 1:
        return f"a hard link ({info.st_nlink} names for one file: it may be someone else's)"
    elif info.st_size > max_bytes:
        return f"{info.st_size} bytes, more than the {max_bytes} a file may have"
    if owner is not None and info.st_uid != owner:
        return f"owned by user id {info.st_uid}, not by the student (user id {owner})"
    return None


def open_folder(base, relative=""):
    """A file descriptor of the folder `relative` below `base`, every component of `relative` opened with
    O_NOFOLLOW relative to the one above (`base` itself is the caller's and may be reached by any path).
    Raises OSError (ELOOP for a link) otherwise; close the descriptor when done."""
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in [p for p in str(relative).split("/") if p not in ("", ".")]:
            if part == "..":
                raise OSError(errno.EPERM, "'..' in a student's path")
            try:
                below = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except NotADirectoryError:  # what O_DIRECTORY | O_NOFOLLOW says of a link: say it is one
                if stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode):
                    raise OSError(errno.ELOOP, "a symbolic link", part) from None
                raise
            os.close(fd)
            fd = below
        return fd
    except BaseException:
        os.close(fd)
        raise


class TooLarge(OSError):
    """The file grew past the limit while it was read (its owner kept writing)."""


def _copy_fd(source_fd, target_dir_fd, name, max_bytes, mode=0o644):
    """Copy the open file `source_fd` into a new file `name` of the folder `target_dir_fd`, at most
    `max_bytes` of it (TooLarge past that: the partial copy is removed)."""
    out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                  dir_fd=target_dir_fd)
    copied = 0
    try:
        while chunk := os.read(source_fd, CHUNK):
            copied += len(chunk)
            if copied > max_bytes:
                raise TooLarge(errno.EFBIG, f"it grew past {max_bytes} bytes while it was copied")
            view = memoryview(chunk)
            while view:
                view = view[os.write(out, view):]
        os.fchmod(out, mode)
    except BaseException:
        os.close(out)
        out = None
        os.unlink(name, dir_fd=target_dir_fd)
        raise
    finally:
        if out is not None:
            os.close(out)


def _open_entry(name, dir_fd, folder=False):
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    if folder:
        flags |= os.O_DIRECTORY
    return os.open(name, flags, dir_fd=dir_fd)


def copy_regular_files(base, relative, target, *, owner=None, max_bytes=MAX_BYTES, max_files=MAX_FILES,
                       max_depth=MAX_DEPTH):
    """Copy the folder `relative` below `base` (a folder the caller trusts, e.g. `autograder/submitted`)
    into `target` (made if missing; its parents are the caller's), taking regular files only (see the
    module's docstring). `owner`: the user id every folder and file must belong to (None: any).
    Returns Taken; raises OSError only when the folder itself cannot be opened as a folder (a link
    included: ELOOP) or `target` cannot be written."""
    taken = Taken()
    source_fd = open_folder(base, relative)
    try:
        refused = _judge_opened(os.fstat(source_fd), owner, max_bytes, folder=True)
        if refused:
            taken.refused.append((".", refused))
            return taken
        os.makedirs(target, exist_ok=True)
        target_fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            _copy_folder(source_fd, target_fd, "", taken, owner, max_bytes, [max_files], max_depth)
        finally:
            os.close(target_fd)
    finally:
        os.close(source_fd)
    return taken


def _copy_folder(source_fd, target_fd, prefix, taken, owner, max_bytes, budget, depth):
    with os.scandir(source_fd) as entries:
        names = sorted(entry.name for entry in entries)
    for name in names:
        path = f"{prefix}{name}"
        if budget[0] <= 0:
            taken.refused.append((path, "one file too many (a submission keeps at most "
                                        f"{MAX_FILES} files and folders)"))
            continue
        budget[0] -= 1
        try:
            listed = os.stat(name, dir_fd=source_fd, follow_symlinks=False)
        except OSError as exc:
            taken.refused.append((path, _refusal(exc)))
            continue
        folder = stat.S_ISDIR(listed.st_mode)
        if not folder and not stat.S_ISREG(listed.st_mode):  # never opened: a FIFO, a link, a device
            taken.refused.append((path, _kind(listed.st_mode)))
            continue
        if folder and depth <= 0:
            taken.refused.append((path, f"a folder deeper than {MAX_DEPTH} levels"))
            continue
        try:
            fd = _open_entry(name, source_fd, folder)
        except OSError as exc:  # swapped for a link (ELOOP) or a FIFO's cousin since it was listed
            taken.refused.append((path, _refusal(exc)))
            continue
        try:
            refused = _judge_opened(os.fstat(fd), owner, max_bytes, folder)
            if refused:
                taken.refused.append((path, refused))
                continue
            if folder:
                os.mkdir(name, 0o755, dir_fd=target_fd)
                below = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                dir_fd=target_fd)
                try:
                    _copy_folder(fd, below, f"{path}/", taken, owner, max_bytes, budget, depth - 1)
                finally:
                    os.close(below)
                continue
            os.set_blocking(fd, True)
            try:
                _copy_fd(fd, target_fd, name, max_bytes)
            except TooLarge as exc:
                taken.refused.append((path, exc.strerror))
                continue
            except OSError as exc:
                taken.refused.append((path, f"could not be read ({os.strerror(exc.errno)})"))
                continue
            taken.files.append(path)
        finally:
            os.close(fd)


def copy_regular_file(path, target, *, owner=None, max_bytes=MAX_BYTES):
    """Copy the one file `path` to the new file `target`, if `path` is a regular file (its last component
    opened without following a link; the folders above are the caller's). Returns None when copied,
    else why it was refused ("a symbolic link", ...)."""
    folder, name = os.path.split(os.path.abspath(path))
    try:
        dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        return _refusal(exc) if exc.errno != errno.ENOENT else "no such file"
    try:
        try:
            fd = _open_entry(name, dir_fd)
        except OSError as exc:
            return _refusal(exc) if exc.errno != errno.ENOENT else "no such file"
        try:
            refused = _judge_opened(os.fstat(fd), owner, max_bytes)
            if refused:
                return refused
            os.set_blocking(fd, True)
            parent, leaf = os.path.split(os.path.abspath(target))
            target_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                _copy_fd(fd, target_fd, leaf, max_bytes)
            except TooLarge as exc:
                return exc.strerror
            finally:
                os.close(target_fd)
            return None
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)
