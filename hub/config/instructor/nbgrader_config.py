"""What the hub adds to nbgrader's configuration for the instructor of a class (`make hub`).

The instructor's JUPYTER_CONFIG_PATH is this folder, then autograder/ (the course's own
nbgrader_config.py, which nbgrader loads too: the course root, the exchange, the judge).

- The exchange: nbgrader's filesystem exchange with the class's rules (exchange_rules.py), and a collect
  (`SafeCollect`) that takes only what a student really submitted; or ngshare (EXCHANGE=ngshare).
- Grading: every judge runs in the class's grading service (hub/grading_service.py, as root), so that
  each submission gets its own pid namespace, cgroup (processes, memory) and user ids, exactly as
  `make autograde` run by root; the formgrader's Autograde button goes through it too.
"""

import glob
import os
import pwd
import shutil
import sys

c = get_config()  # noqa: F821 - provided by traitlets when it loads this file
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the class's config/

import exchange_rules  # noqa: E402
import student_files  # noqa: E402

if os.environ.get("DPCOURSE_GRADING_SOCKET"):
    sys.path.insert(0, os.path.join(os.environ["DPCOURSE_REPO"], "hub"))
    import grading_client  # noqa: E402

    grading_client.install()  # the formgrader's Autograde button: each notebook judged by the service


def owner(path):
    try:
        return pwd.getpwuid(os.lstat(path).st_uid).pw_name
    except (KeyError, OSError):
        return None


def uid_of(user):
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        return None


if exchange_rules.kind() == "ngshare":
    exchange_rules.use_ngshare(c)
else:
    from nbgrader.exchange.default.collect import ExchangeCollect
    from nbgrader.exchange.default.list import ExchangeList
    from nbgrader.exchange.default.release_assignment import ExchangeReleaseAssignment
    from nbgrader.exchange.default.release_feedback import ExchangeReleaseFeedback
    from nbgrader.utils import ignore_patterns

    class SafeCollect(exchange_rules.CourseFolderRoot, ExchangeCollect):
        """nbgrader's collect, taking of each student the newest submission that is really theirs.

        Really theirs: a folder the student owns (a submission's folder is named after the student id
        the submitter gave, and `nbgrader submit --student=ada` works for anyone: nbgrader's collect only
        warns and takes it as ada's newest), holding regular files the student owns only, copied without
        following a link (student_files.py: a student may replace their notebook in the exchange by a
        link to the solutions, which nbgrader's copy would follow as the instructor). A submission that is
        not is left out with a warning the instructor sees in the Collect dialog, the student's newest
        submission that is really theirs is taken instead, and what was collected before stays as it is
        unless that one is newer.
        """

        def init_src(self):
            super().init_src()  # each student's newest submission (or the newest before the due date)
            kept = []
            for record in self.src_records:
                chosen = self._really_theirs(record)
                if chosen is not None:
                    kept.append(chosen)
            self.src_records = kept

        def _really_theirs(self, record):
            student, uid = record["username"], uid_of(record["username"])
            own = f"{glob.escape(student)}+{self.coursedir.assignment_id}+*"
            pattern = os.path.join(self.inbound_path, own)
            candidates = [self._path_to_record(path) for path in glob.glob(pattern)]
            candidates = [r for r in self._sort_by_timestamp(candidates)
                          if r["timestamp"] <= record["timestamp"]]
            for candidate in candidates:
                path = os.path.join(self.inbound_path, candidate["filename"])
                maker = owner(path)
                if maker != student:
                    self.log.warning(f"{candidate['filename']} was submitted in {student}'s name by {maker}: "
                                     f"not collected")
                    continue
                wrong = student_files.problems(path, uid, self._ignore())
                if wrong:
                    self.log.warning(f"{candidate['filename']} is not collected: " + "; ".join(wrong[:5]))
                    continue
                if candidate is not candidates[0]:
                    self.log.warning(f"{student}'s submission of {candidate['timestamp']} (their newest that "
                                     f"is really theirs) is collected instead")
                return candidate
            self.log.warning(f"no submission of {student}'s is collected (what was collected before, if "
                             f"anything, is kept)")
            return None

        def _ignore(self):
            return ignore_patterns(exclude=self.coursedir.ignore, include=self.coursedir.include,
                                   max_file_size=self.coursedir.max_file_size, log=self.log)

        def copy_files(self):
            """nbgrader's choice of what to collect (a newer submission, or a different one when collecting
            up to the due date), each copied whole through student_files or not at all."""
            if not self.src_records:
                self.log.warning(f"No submissions of '{self.coursedir.assignment_id}' for course "
                                 f"'{self.coursedir.course_id}' to collect")
            for record in self.src_records:
                student = record["username"]
                src = os.path.join(self.inbound_path, record["filename"])
                dest = self.coursedir.format_path(self.coursedir.submitted_directory, student,
                                                  self.coursedir.assignment_id)
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                if os.path.isdir(dest):
                    existing = self.coursedir.get_existing_timestamp(dest)
                    newer = self.update and (existing is None or record["timestamp"] > existing)
                    other = self.before_duedate and existing != record["timestamp"]
                    if not (newer or other):
                        self.log.info(f"No newer submission to collect: {student} "
                                      f"{self.coursedir.assignment_id}")
                        continue
                staged = f"{dest}.collecting"
                shutil.rmtree(staged, ignore_errors=True)
                try:
                    student_files.copy_tree(src, staged, uid_of(student), ignore=self._ignore(),
                                            max_bytes=1000 * self.coursedir.max_dir_size)
                except student_files.Refused as refused:
                    self.log.warning(f"{record['filename']} is not collected: {refused}; what was collected "
                                     f"of {student}'s before, if anything, is kept")
                    shutil.rmtree(staged, ignore_errors=True)
                    continue
                if os.path.isdir(dest):
                    self.log.info(f"Updating submission: {student} {self.coursedir.assignment_id}")
                    shutil.rmtree(dest)
                else:
                    self.log.info(f"Collecting submission: {student} {self.coursedir.assignment_id}")
                os.rename(staged, dest)

    class CourseReleaseAssignment(exchange_rules.CourseFolderRoot, ExchangeReleaseAssignment):
        """nbgrader's release, which would chmod the exchange's root to 0777: the course's folder instead."""

    class CourseReleaseFeedback(exchange_rules.CourseFolderRoot, ExchangeReleaseFeedback):
        pass

    class CourseList(exchange_rules.CourseFolderRoot, ExchangeList):
        pass

    c.ExchangeFactory.collect = SafeCollect
    c.ExchangeFactory.release_assignment = CourseReleaseAssignment
    c.ExchangeFactory.release_feedback = CourseReleaseFeedback
    c.ExchangeFactory.list = CourseList
