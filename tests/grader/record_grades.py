"""Record what grading gives now in each chapter's expected_grades.json, the table test_grading compares with.

    .venv/bin/python tests/grader/record_grades.py 04_ring_allreduce      # re-record one assignment
    .venv/bin/python tests/grader/record_grades.py                        # every assignment

Re-record only for a deliberate change of points or messages, and let the diff of
autograder/dpgrader/<chapter>/expected_grades.json show the change in the same commit. Per graded
notebook (solution, released, each variant), per graded cell: points, max_points and the first line
of the message, as `first_line` normalises it. The judge grades a planted bug only on the cells it
lists: cells recorded earlier and not judged now are kept as they were.
"""

import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from grading import ASSIGNMENTS, expected_grades, expected_grades_path, table_of  # noqa: E402
from judging import judged_assignment  # noqa: E402


def main(argv):
    for assignment in argv or ASSIGNMENTS:
        with tempfile.TemporaryDirectory() as tmp:
            judged = table_of(judged_assignment(assignment, Path(tmp)))
        before = expected_grades(assignment) or {}
        table = {name: {**before.get(name, {}), **cells} for name, cells in judged.items()}
        print(assignment, {name: sum(c["points"] or 0 for c in cells.values())
                           for name, cells in table.items()})
        expected_grades_path(assignment).write_text(
            json.dumps(table, indent=1, sort_keys=True, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
