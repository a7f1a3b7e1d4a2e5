"""Copying files a student made, as someone who may read more than they may: never follow their links.

    problems(src, owner_uid)       # [] or ["nb.ipynb is a symbolic link", ...]
    copy_tree(src, dest, owner_uid, ignore=..., max_bytes=...)   # raises Refused(problems)
    copy_file(src, dest, owner_uid)

Why: a student's submission folder in nbgrader's exchange is theirs to change after they submitted. The
instructor's collect runs as the instructor, who may read the solutions; nbgrader's copy follows a
symbolic link the student left in place of their notebook, and collects the solution as their
submission (issue 28: 11 of 13 points with no code written, the whole solution in their feedback). So
whatever reads a student's files on someone else's behalf takes regular files that student owns only,
each opened without following a link (O_NOFOLLOW, relative to an already opened folder, so that no part
of the path can be swapped for a link in between), and checked again once open (fstat: the same file,
still regular, still theirs, one link). A symbolic link, a hard link (someone else's file, or one kept
elsewhere), a FIFO, a socket or a device is refused, with the reason, and nothing of that submission is
copied: a submission is taken whole or not at all.

The hub's collect and fetch-feedback (hub/config/*/nbgrader_config.py) use it. The grader has its own
copier with the same rules (autograder/dpgrader/safe_copy.py, for `make autograde` and `make grade`), and
the two are kept apart on purpose: this one runs in every student's server (fetch-feedback), which may
not read autograder/, so it lives in hub/config/, which setup_class.py copies where every server of the
class can read it (hub/ itself is closed to students); and a collect takes a submission whole or not at
all (the student's previous real submission is then kept), where autograde keeps a submission's other
regular files and lists what it left out.
"""

import os
import stat

MAX_BYTES = 100 << 20  # what one submission may hold in all (nbgrader's own default max_dir_size: 100 MB)
MAX_FILES = 1000
CHUNK = 1 << 20


class Refused(RuntimeError):
    """A student's folder holds something that is not a regular file of theirs; `problems` lists each."""

    def __init__(self, problems):
        super().__init__("; ".join(problems))
        self.problems = problems


def _kind(mode):
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return name
    return "not a regular file"


def _why_not(info, owner_uid, folder=False):
    """Why an entry (its lstat or fstat) is not one to copy, or None."""
    if folder:
        if not stat.S_ISDIR(info.st_mode):
            return _kind(info.st_mode)
    elif not stat.S_ISREG(info.st_mode):
        return "a folder" if stat.S_ISDIR(info.st_mode) else _kind(info.st_mode)
    if info.st_uid != owner_uid:
        return f"owned by uid {info.st_uid}, not by the student (uid {owner_uid})"
    if not folder and info.st_nlink != 1:
        return f"a hard link ({info.st_nlink} names for one file)"
    return None


def _open_folder(name, dir_fd, owner_uid):
    """An fd of the folder `name` (in dir_fd, or a path when dir_fd is None), or raise Refused."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        try:
            kind = _kind(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        except OSError:
            kind = f"not a folder one can open ({exc.strerror})"
        raise Refused([f"{name} is {kind}"]) from None
    why = _why_not(os.fstat(fd), owner_uid, folder=True)
    if why:
        os.close(fd)
        raise Refused([f"{name} is {why}"])
    return fd


def _walk(fd, owner_uid, src, prefix, found, problems, ignore):
    """Fill `found` with (relative path, parent fd, name) of every regular file, `problems` with the rest."""
    names = sorted(os.listdir(fd))
    skipped = set(ignore(os.path.join(src, prefix), names)) if ignore else set()
    for name in names:
        if name in skipped:
            continue
        relative = os.path.join(prefix, name) if prefix else name
        info = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if stat.S_ISDIR(info.st_mode):
            try:
                child = _open_folder(name, fd, owner_uid)
            except Refused as exc:
                problems.extend(f"{relative}: {p.split(' is ', 1)[-1]}" for p in exc.problems)
                continue
            found.append((relative, None, child))  # a folder: kept open for the copy
            _walk(child, owner_uid, src, relative, found, problems, ignore)
            continue
        why = _why_not(info, owner_uid)
        if why:
            problems.append(f"{relative} is {why}")
        else:
            found.append((relative, fd, name))
        if len(found) > MAX_FILES:
            problems.append(f"more than {MAX_FILES} files")
            return


def _scan(src, owner_uid, ignore=None):
    """(top fd, [(relative, parent fd or None for a folder, name or folder fd)], problems)."""
    top = _open_folder(os.fspath(src), None, owner_uid)
    found, problems = [], []
    try:
        _walk(top, owner_uid, os.fspath(src), "", found, problems, ignore)
    except OSError as exc:
        problems.append(f"cannot be read: {exc.strerror}")
    return top, found, problems


def _close(top, found):
    for _, parent, what in found:
        if parent is None:
            os.close(what)
    os.close(top)


def problems(src, owner_uid, ignore=None):
    """What in the folder `src` is not a regular file (or folder) owned by `owner_uid`: [] if nothing."""
    try:
        top, found, problems = _scan(src, owner_uid, ignore)
    except Refused as exc:
        return exc.problems
    _close(top, found)
    return problems


def _read(parent, name, owner_uid, budget):
    """The bytes of `name` in the folder `parent`, opened without following a link and checked once open."""
    before = os.stat(name, dir_fd=parent, follow_symlinks=False)
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent)
    try:
        info = os.fstat(fd)
        why = _why_not(info, owner_uid)
        if why or (info.st_dev, info.st_ino) != (before.st_dev, before.st_ino):
            raise Refused([f"{name} is {why or 'a different file from the one listed (changed meanwhile)'}"])
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, CHUNK)
            if not chunk:
                return b"".join(chunks)
            total += len(chunk)
            if total > budget:
                raise Refused([f"holds more than {MAX_BYTES >> 20} MiB"])
            chunks.append(chunk)
    finally:
        os.close(fd)


def copy_tree(src, dest, owner_uid, ignore=None, max_bytes=MAX_BYTES):
    """Copy the folder `src` (a student's, uid `owner_uid`) to `dest` (made here; must not exist), taking
    regular files that student owns only, none through a link. Raises Refused, copying nothing, if `src`
    holds anything else or more than `max_bytes`. `ignore(relative folder, names) -> names to leave out`
    (nbgrader's CourseDirectory.ignore / include / max_file_size, shutil.copytree's form)."""
    top, found, refused = _scan(src, owner_uid, ignore)
    try:
        if refused:
            raise Refused(refused)
        contents, left = [], max_bytes
        for relative, parent, name in found:
            if parent is not None:
                data = _read(parent, name, owner_uid, left)
                left -= len(data)
                contents.append((relative, data))
            else:
                contents.append((relative, None))
    finally:
        _close(top, found)
    os.makedirs(dest)
    for relative, data in contents:
        target = os.path.join(dest, relative)
        if data is None:
            os.makedirs(target, exist_ok=True)
            continue
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
    return [relative for relative, data in contents if data is not None]


def copy_file(src, dest, owner_uid, max_bytes=MAX_BYTES):
    """One regular file of `owner_uid` to `dest`, never through a link at either end: `dest` is written
    anew and renamed into place (a link there is replaced, not followed)."""
    folder, name = os.path.split(os.fspath(src))
    fd = os.open(folder or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)  # a folder one may only pass
    try:
        data = _read(fd, name, owner_uid, max_bytes)
    finally:
        os.close(fd)
    temporary = f"{dest}.{os.getpid()}.part"
    out = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(out, "wb") as f:
        f.write(data)
    os.replace(temporary, dest)
