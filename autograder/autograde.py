"""Grade the whole class: every submission in the submitted folder, into the gradebook.

    python autograder/autograde.py          # what `make autograde` runs

For each assignment with submissions (submitted/<student>/<assignment>/): record
the assignment in the gradebook (generate_assignment), autograde every
submission, write feedback (hidden tests cleared, see nbgrader_config.py), then
export every grade to grades.csv. The course root and gradebook come from
nbgrader_config.py (DPCOURSE_COURSE_ROOT / DPCOURSE_DB_URL override them).
"""

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def course_root():
    return Path(os.environ.get("DPCOURSE_COURSE_ROOT", HERE.parent))


def nbgrader(*args):
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    print("$ nbgrader", *args, flush=True)
    subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=HERE, env=env, check=True,
                   timeout=6 * 3600)


def submitted_assignments(root):
    submitted = root / "autograder" / "submitted"
    return sorted({p.name for p in submitted.glob("*/*") if p.is_dir()})


def main():
    root = course_root()
    assignments = submitted_assignments(root)
    if not assignments:
        print(f"no submissions in {root / 'autograder' / 'submitted'} "
              "(expected submitted/<student>/<assignment>/<notebook>.ipynb)")
    for assignment in assignments:
        if not (root / "solutions" / assignment).is_dir():
            print(f"skipping {assignment}: no such assignment in solutions/")
            continue
        nbgrader("generate_assignment", assignment, "--force")
        nbgrader("autograde", assignment, "--force")
        nbgrader("generate_feedback", assignment, "--force")
    nbgrader("export", "--to", str(root / "autograder" / "grades.csv"))
    print(f"grades: {root / 'autograder' / 'grades.csv'}; feedback: {root / 'autograder' / 'feedback'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
