"""Make a class of this course on this machine, for JupyterHub (`make hub` runs it, as root).

    python hub/setup_class.py --root /srv/dpcourse-hub --instructor teacher --students "ada bob"
    python hub/setup_class.py ... --exchange ngshare          # nbgrader's exchange as a service (ngshare)
    python hub/setup_class.py --root /srv/dpcourse-hub --remove   # the class's users, group and files go;
                                                                  # the repository gets its permissions back

What it makes (run again, it keeps the gradebook, the submissions and the exchange, and gives every user
a new password):
  users        the instructor and each student: a system user with a random password (the hub logs
               them in with PAM) and a home under ROOT/home/ that only they may enter (0700);
  staff group  STAFF (the instructor): the only users besides root who may read the repository beyond
               what a learner's server needs;
  exchange     filesystem (the default): ROOT/exchange, nbgrader's exchange, root's and closed to writing
               (0755), holding the class's course folder, the instructor's (nbgrader wants the root
               writable by everyone, 1777, which lets any student make a folder claiming another
               course's name; hub/config/exchange_rules.py); or ngshare: ROOT/ngshare, the database and
               files of the ngshare service (hub/ngshare_service.py), owned by the system user
               EXCHANGE_USER, with the course, its instructor and its students already in it;
  grading      ROOT/grading (root:STAFF, 0750): the socket of the class's grading service
               (hub/grading_service.py), through which the instructor's grading runs as root;
  course root  ~INSTRUCTOR/dpcourse, nbgrader's course root for the class: solutions/ (a link to the
               repository's), course/ (what is released), autograder/ (submissions, feedback, the
               gradebook, which lists the class's students from the start);
  configs      ROOT/config/{student,instructor}: each role's Jupyter configuration (from hub/config/);
  hub state    ROOT/hub (root only): class.json (jupyterhub_config.py reads it), passwords.json, the
               hub's database and cookie secret, and the repository's permissions before the class;
  repository   closed to other users: every entry at its top but .venv/ (the Python environment every
               server runs) and course/ (the released notebooks and the dpcourse library) is given to
               STAFF with no permission for others. So a student's server can run the course and read
               nothing of solutions/ or autograder/ (the hidden checks, the planted bugs, the recorded
               grades).

Users are marked as the class's (their comment field) and a user of that name that is not is never
touched. The repository's folders above it must let other users through (o+x): the students' servers
run its .venv. `--remove` also deletes what the class's users left in /tmp, /var/tmp and /dev/shm
(torch's /tmp/torchinductor_<user> among them), which the next user given the same uid would inherit.
"""

import argparse
import grp
import json
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

HUB = Path(__file__).resolve().parent
REPO = HUB.parent
sys.path.insert(0, str(HUB))  # user_cgroup
PUBLIC = (".venv", "course")  # what a student's server needs from the repository; the rest is closed
COURSE_ID = "dpcourse"
MARK = "dpcourse class"  # the comment (GECOS) field of the users this script made


class SetupError(RuntimeError):
    """The class cannot be made here; the message says why and what to do."""


def run(*command, **kwargs):
    subprocess.run(command, check=True, capture_output=True, text=True, **kwargs)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def home_of(root, user):
    return root / "home" / user


def check_reachable(root):
    """The repository's .venv and course/, and the class's folder (homes, exchange), must be reachable
    by every user: o+x on every folder above them."""
    for folder in [REPO, *REPO.parents]:
        if not folder.stat().st_mode & 0o001:
            raise SetupError(
                f"students' servers run the course's Python environment ({REPO / '.venv'}), but {folder} "
                f"does not let other users through: `chmod o+x {folder}` or clone the course elsewhere "
                f"(e.g. /srv/dpcourse) and run `make hub` there")
    for folder in root.parents:
        if folder.exists() and not folder.stat().st_mode & 0o001:
            raise SetupError(f"the class's homes and exchange go under {root}, but {folder} does not let "
                             f"other users through: choose another HUB_ROOT (e.g. /srv/dpcourse-hub)")


def ensure_group(name):
    run("groupadd", "-f", name)


def ensure_user(name, home, groups=(), shell="/bin/bash"):
    """A system user of the class (created, or one this script made before, moved to `home`)."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        run("useradd", "--home-dir", str(home), "--no-create-home", "--shell", shell,
            "--comment", MARK, "--user-group", name)
    else:
        if entry.pw_gecos != MARK:
            raise SetupError(f"a user named {name} already exists and is not one of a class made here: "
                             f"choose other names (make hub HUB_STUDENTS=... HUB_INSTRUCTOR=...)")
        run("usermod", "--home", str(home), name)
    if groups:
        run("usermod", "--append", "--groups", ",".join(groups), name)
    entry = pwd.getpwnam(name)
    home.mkdir(parents=True, exist_ok=True)
    os.chown(home, entry.pw_uid, entry.pw_gid)
    os.chmod(home, 0o700)
    return entry


def set_passwords(users):
    """A new random password for each user (PAM checks it at login); returns {user: password}."""
    passwords = {user: secrets.token_urlsafe(12) for user in users}
    subprocess.run(["chpasswd"], input="".join(f"{u}:{p}\n" for u, p in passwords.items()), text=True,
                   check=True, capture_output=True)
    return passwords


def make_exchange(root, instructor):
    """The filesystem exchange: root's, 0755 (no student can make a folder in it), with the course's folder
    the instructor's (nbgrader's release makes inbound/, outbound/ and feedback/ in it)."""
    exchange = root / "exchange"
    exchange.mkdir(parents=True, exist_ok=True)
    os.chown(exchange, 0, 0)
    os.chmod(exchange, 0o755)
    for entry in exchange.iterdir():  # what anyone made there while the root was 1777 (an earlier class)
        if entry.name == COURSE_ID:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink()
    course = exchange / COURSE_ID
    if course.is_symlink() or (course.exists() and not course.is_dir()):
        course.unlink()
    course.mkdir(exist_ok=True)
    os.chown(course, instructor.pw_uid, instructor.pw_gid)
    os.chmod(course, 0o755)
    return exchange


def make_ngshare(root, klass, owner):
    """ngshare's database (made as ngshare itself would: its alembic migrations) and files folder, owned by
    the exchange's user, with the class's course, its instructor and its students enrolled, so that the
    exchange works from the first request (ngshare creates courses for its admins only, and this class
    has none)."""
    from ngshare import dbutil
    from ngshare.database import Course, User
    from sqlalchemy import create_engine
    from sqlalchemy.orm import sessionmaker

    folder = root / "ngshare"
    (folder / "files").mkdir(parents=True, exist_ok=True)
    url = f"sqlite:///{folder / 'ngshare.db'}"

    class Options:  # what ngshare's own start passes its migrations (ngshare.main: data=true, storage=...)
        x = ["data=true", f"storage={folder / 'files'}"]

    dbutil.upgrade(url, cmd_opts=Options)
    engine = create_engine(url)
    with sessionmaker(bind=engine)() as db:
        def user(name):
            found = db.query(User).filter(User.id == name).one_or_none()
            if found is None:
                found = User(name)
                db.add(found)
            return found

        course = db.query(Course).filter(Course.id == klass["course_id"]).one_or_none()
        if course is None:
            course = Course(klass["course_id"], [user(klass["instructor"])])
            db.add(course)
        for name in klass["students"]:
            student = user(name)
            if student not in course.students:
                course.students.append(student)
        db.commit()
    engine.dispose()
    for path in [folder, *folder.rglob("*")]:
        os.chown(path, owner.pw_uid, owner.pw_gid, follow_symlinks=False)
    os.chmod(folder, 0o700)


def make_course_root(home, instructor, students):
    """The instructor's course root (see the module docstring), with the class list in its gradebook."""
    course = home / "dpcourse"
    for folder in (course, course / "course", course / "autograder"):
        folder.mkdir(parents=True, exist_ok=True)
    link = course / "solutions"
    if not link.is_symlink():
        link.symlink_to(REPO / "solutions")
    # nbgrader makes a new gradebook with the `alembic` command of the environment
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course / 'autograder' / 'gradebook.db'}", COURSE_ID) as gradebook:
        for student in students:
            gradebook.update_or_create_student(student)
    for path in [course, *course.rglob("*")]:
        os.chown(path, instructor.pw_uid, instructor.pw_gid, follow_symlinks=False)
    os.chmod(course, 0o700)
    return course


def install_configs(root):
    """Each role's Jupyter configuration (hub/config/), where their servers read it (hub/ is closed to
    students)."""
    target = root / "config"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(HUB / "config", target, ignore=shutil.ignore_patterns("__pycache__"))
    for path in [target, *target.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    return target


def close_repository(state, staff_gid):
    """Every top-level entry but PUBLIC: group STAFF, nothing for others. What each was before is kept in
    state/repository.json (the first time only: a second run must not record the closed state)."""
    saved_path = state / "repository.json"
    saved = json.loads(saved_path.read_text()) if saved_path.exists() else {}
    for entry in sorted(REPO.iterdir()):
        if entry.name in PUBLIC or entry.is_symlink():
            continue
        info = entry.lstat()
        saved.setdefault(entry.name, {"mode": info.st_mode & 0o7777, "gid": info.st_gid})
        os.chown(entry, -1, staff_gid)
        group = 0o050 if entry.is_dir() else 0o040
        os.chmod(entry, (info.st_mode & 0o7770) | group)
    saved_path.write_text(json.dumps(saved, indent=1))
    git = REPO / ".git"
    if git.is_file():  # a worktree: the history (every solution ever committed) lives elsewhere
        print(f"note: this clone's git history is in {git.read_text().split(':', 1)[1].strip()}, "
              f"which stays readable to whoever may read it now")


def reopen_repository(state):
    saved_path = state / "repository.json"
    if not saved_path.exists():
        return
    for name, before in json.loads(saved_path.read_text()).items():
        entry = REPO / name
        if entry.exists() and not entry.is_symlink():
            os.chown(entry, -1, before["gid"])
            os.chmod(entry, before["mode"])
    saved_path.unlink()


def check_student_view(student):
    """A student can run the course's environment and read the released course: checked as that user."""
    needed = [REPO / ".venv" / "bin" / "jupyterhub-singleuser", REPO / "course" / "dpcourse" / "__init__.py"]
    probe = subprocess.run(["runuser", "-u", student, "--", "test", "-r", needed[0], "-a", "-r", needed[1]])
    if probe.returncode != 0:
        raise SetupError(f"the student {student} cannot read {needed[0]} or {needed[1]}: the repository's "
                         f"files must be readable by others (umask 022 when it was cloned and installed)")


def setup(root, instructor, students, staff, port, exchange="filesystem", exchange_user="dpcourse-exchange"):
    started = time.monotonic()
    if os.geteuid() != 0:
        raise SetupError("making a class creates system users: run it as root (sudo make hub)")
    if not students or instructor in students:
        raise SetupError("a class needs an instructor and at least one student, all different")
    check_reachable(root)
    state = root / "hub"
    state.mkdir(parents=True, exist_ok=True)
    for folder, mode in ((root, 0o755), (state, 0o700)):
        os.chmod(folder, mode)
    home = instructor_home = home_of(root, instructor)
    klass = {"repo": str(REPO), "root": str(root), "instructor": instructor, "students": students,
             "staff_group": staff, "course_id": COURSE_ID, "exchange": str(root / "exchange"),
             "course_root": str(instructor_home / "dpcourse"), "config": str(root / "config"),
             "port": port or free_port(), "exchange_kind": exchange,
             "grading_socket": str(root / "grading" / "judge.sock")}
    if exchange == "ngshare":
        if exchange_user in (instructor, *students):
            raise SetupError("the exchange's user must be none of the class's users")
        ngshare_port = free_port()
        klass.update(exchange_user=exchange_user, ngshare_port=ngshare_port,
                     ngshare_url=f"http://127.0.0.1:{ngshare_port}/services/ngshare")
    (state / "class.json").write_text(json.dumps(klass, indent=1))  # first: --remove finds the users
    home.parent.mkdir(exist_ok=True)
    os.chmod(home.parent, 0o755)
    ensure_group(staff)
    teacher = ensure_user(instructor, instructor_home, groups=[staff])
    for student in students:
        ensure_user(student, home_of(root, student))
    passwords = set_passwords([instructor, *students])
    (state / "passwords.json").touch(mode=0o600)
    (state / "passwords.json").write_text(json.dumps(passwords, indent=1))
    if exchange == "ngshare":
        make_ngshare(root, klass, ensure_user(exchange_user, root / "ngshare", shell="/usr/sbin/nologin"))
    else:
        make_exchange(root, teacher)
    make_course_root(instructor_home, teacher, students)
    install_configs(root)
    close_repository(state, grp.getgrnam(staff).gr_gid)
    check_student_view(students[0])
    took = time.monotonic() - started
    print(f"class ready in {took:.1f} s: open http://localhost:{klass['port']}/ and log in as")
    for user, password in passwords.items():
        role = "student (Nbgrader > Assignment List)"
        if user == instructor:
            role = "instructor (Nbgrader > Formgrader)"
        print(f"  {user:<16} password {password:<18} {role}")
    print(f"(passwords also in {state / 'passwords.json'}, root only)")
    return klass


def remove(root):
    """Undo setup: the repository's permissions, the class's users and group, ROOT."""
    if os.geteuid() != 0:
        raise SetupError("removing a class deletes system users: run it as root")
    state = root / "hub"
    reopen_repository(state)
    klass_path = state / "class.json"
    if klass_path.exists():
        klass = json.loads(klass_path.read_text())
        users = [klass["instructor"], *klass["students"], *filter(None, [klass.get("exchange_user")])]
        ours = {}
        for user in users:
            try:
                entry = pwd.getpwnam(user)
            except KeyError:
                continue
            if entry.pw_gecos == MARK:
                ours[entry.pw_uid] = user
        remove_leftovers(ours)
        for user in ours.values():
            run("userdel", user)
        subprocess.run(["groupdel", klass["staff_group"]], capture_output=True)
    shutil.rmtree(root, ignore_errors=True)


SHARED_SCRATCH = ("/tmp", "/var/tmp", "/dev/shm")


def remove_leftovers(uids):
    """What the class's users left in the machine's shared scratch folders (top-level entries they own:
    torch's /tmp/torchinductor_<user>, a kernel's files), and their servers' cgroups: gone, so that no
    later user given the same uid inherits them."""
    from user_cgroup import UserCgroup

    for folder in SHARED_SCRATCH:
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid not in uids:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
            except OSError:
                continue
    for user in uids.values():
        group = UserCgroup(user)
        group.kill_all()
        group.remove()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, required=True, help="the class's folder: homes, exchange, state")
    parser.add_argument("--instructor", default="instructor")
    parser.add_argument("--students", default="student-a student-b", help="user names, separated by spaces")
    parser.add_argument("--staff-group", default="dpcourse-staff")
    parser.add_argument("--port", type=int, default=0, help="the hub's port (0: a free one)")
    parser.add_argument("--exchange", choices=("filesystem", "ngshare"), default="filesystem",
                        help="nbgrader's exchange: a shared folder, or the ngshare service")
    parser.add_argument("--exchange-user", default="dpcourse-exchange",
                        help="the system user the ngshare service runs as (--exchange ngshare)")
    parser.add_argument("--remove", action="store_true", help="remove the class made under --root")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    try:
        if args.remove:
            remove(root)
        else:
            setup(root, args.instructor, args.students.split(), args.staff_group, args.port, args.exchange,
                  args.exchange_user)
    except (SetupError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or ""
        print(f"make hub: {exc} {detail.strip()}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
