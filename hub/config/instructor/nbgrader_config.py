"""What the hub adds to nbgrader's configuration for the instructor of a class (`make hub`).

The instructor's JUPYTER_CONFIG_PATH is this folder, then autograder/ (the course's own
nbgrader_config.py, which nbgrader loads too: the course root, the exchange, the judge).
"""

import glob
import os
import pwd

from nbgrader.exchange.default.collect import ExchangeCollect

c = get_config()  # noqa: F821 - provided by traitlets when it loads this file


def owner(path):
    try:
        return pwd.getpwuid(os.lstat(path).st_uid).pw_name
    except KeyError:
        return None


class OwnCollect(ExchangeCollect):
    """nbgrader's collect, which takes a student's submission only from a folder that student owns.

    A submission's folder is named after the student id the submitter gave (`nbgrader submit
    --student=ada` works for anyone), and nbgrader's collect only warns when the folder's owner is
    someone else: it collects it as ada's newest. Here such a folder is left out, with a warning, and
    ada's newest own submission is collected instead.
    """

    def init_src(self):
        super().init_src()  # each student's newest submission (or the newest before the due date)
        kept = []
        for record in self.src_records:
            student = record["username"]
            if owner(os.path.join(self.inbound_path, record["filename"])) == student:
                kept.append(record)
                continue
            pattern = os.path.join(self.inbound_path, f"{student}+{self.coursedir.assignment_id}+*")
            own = [self._path_to_record(path) for path in glob.glob(pattern) if owner(path) == student]
            forger = owner(os.path.join(self.inbound_path, record["filename"]))
            instead = "their newest own submission is collected" if own else "they have none of their own"
            self.log.warning(f"{record['filename']} was submitted in {student}'s name by {forger}: "
                             f"not collected; {instead}")
            if own:
                kept.append(self._sort_by_timestamp(own)[0])
        self.src_records = kept


c.ExchangeFactory.collect = OwnCollect
