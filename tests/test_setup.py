"""The environment files and the repository's form."""

import re
import subprocess
import sys

from conftest import REPO

CONDA_NAMES = {"pytorch": "torch"}  # conda-forge name -> pip name


def names(lines):
    found = set()
    for line in lines:
        line = line.split("#")[0].strip()
        line = line[2:].strip() if line.startswith("- ") else line
        if not line or line.startswith(("-e", "pip", "python")) or line.endswith(":"):
            continue
        name = re.split(r"[<>=!~ \[]", line)[0].lower()
        found.add(CONDA_NAMES.get(name, name))
    return found


def test_environment_yml_names_the_same_packages_as_requirements():
    pip = names((REPO / "requirements.txt").read_text().splitlines())
    conda = names((REPO / "environment.yml").read_text().split("dependencies:")[1].splitlines())
    assert "torch" in pip and "nbgrader" in pip
    assert pip == conda, f"only in requirements.txt: {pip - conda}; only in environment.yml: {conda - pip}"


def test_solution_notebooks_are_committed_without_outputs():
    notebooks = sorted(str(p) for p in (REPO / "solutions").glob("*/*.ipynb"))
    proc = subprocess.run([sys.executable, str(REPO / "autograder" / "notebooks.py"), "--check",
                           *notebooks], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_make_help_lists_every_target_the_readme_names():
    out = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True).stdout
    for target in ["install", "browser-deps", "lab", "assignments", "grade", "autograde", "test", "bench",
                   "clean"]:
        assert re.search(rf"^{target}\s", out, re.M), target
        assert f"make {target}" in (REPO / "README.md").read_text(), target


def test_ci_runs_the_readme_test_command():
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_ci_installs_chromium_and_no_learner_target_does():
    """Chromium is a machine package for the browser tests: CI installs it; `make lab` must not."""
    assert "make browser-deps" in (REPO / ".ci" / "run").read_text()
    for target in ["install", "lab", "formgrader"]:
        out = subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True, text=True).stdout
        assert "apt-get" not in out and "browser-deps" not in out, target
