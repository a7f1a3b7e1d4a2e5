"""The environment files and the repository's form."""

import re
import subprocess
import sys
from pathlib import Path

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
    for target in ["install", "machine-deps", "browser-deps", "lab", "hub", "assignments", "grade",
                   "autograde", "test", "bench", "clean"]:
        assert re.search(rf"^{target}\s", out, re.M), target
        assert f"make {target}" in (REPO / "README.md").read_text(), target


def test_ci_runs_the_readme_test_command():
    assert "make test" in (REPO / ".ci" / "run").read_text()
    assert "sudo make machine-deps" in (REPO / "README.md").read_text()


def test_make_test_installs_the_machine_packages_first_and_no_learner_target_does():
    """Chromium, bubblewrap and Node.js are machine packages: `make test` (what CI runs) sees to them
    first, before the minutes of `make install`; `make lab` never installs any."""
    steps = subprocess.run(["make", "-n", "test"], cwd=REPO, capture_output=True, text=True).stdout
    assert "apt-get install" in steps and "machine packages" in steps, steps[:2000]
    later = [i for i in (steps.find("pip install"), steps.find("ruff check")) if i >= 0]
    assert steps.index("apt-get install") < min(later), steps[:2000]
    for target in ["install", "lab", "formgrader"]:
        out = subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True, text=True).stdout
        assert "apt-get" not in out and "machine-deps" not in out, target


def test_make_test_without_root_stops_at_once_saying_what_to_run():
    """Where a machine package is missing and make test is not run as root, it stops at its first step
    (before `make install`'s minutes), and its one
    line names the command to run. Run as `nobody` with a PATH that has none of them, on a copy of the
    Makefile (the hub test closes the repository to other users while it runs)."""
    import os
    import shutil
    import tempfile

    import pytest

    if os.geteuid() != 0:
        pytest.skip("checked as root, which runs make as an unprivileged user")
    folder = Path(tempfile.mkdtemp(prefix="dpcourse-make-test-"))
    try:
        os.chmod(folder, 0o755)
        shutil.copyfile(REPO / "Makefile", folder / "Makefile")
        os.chmod(folder / "Makefile", 0o644)
        (folder / "bin").mkdir()
        for tool in ("sh", "make", "id"):
            (folder / "bin" / tool).symlink_to(shutil.which(tool))
        proc = subprocess.run(["runuser", "-u", "nobody", "--", "env", f"PATH={folder / 'bin'}", "make", "-s",
                               "-C", str(folder), "test"], capture_output=True, text=True, timeout=60)
    finally:
        shutil.rmtree(folder)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    said = [line for line in lines if not line.startswith(("make:", "make["))]
    assert proc.returncode != 0 and len(said) == 1 and "sudo make machine-deps" in said[0], said
    assert "chromium" in said[0] and "bubblewrap" in said[0] and "nodejs" in said[0], said
    assert "machine-deps] Error" in proc.stderr, f"make test went past its first step: {proc.stderr}"


def test_loadgroup_keeps_a_group_on_one_worker(tmp_path):
    """`make test` runs with --dist loadgroup so that the grading tests of one assignment share one judge
    run (tests/markers.exercise_param). pytest 9.2 with pytest-xdist 3.8 drops the groups without a word
    (pytest-xdist#1386): each of those tests then judged its whole assignment again."""
    (tmp_path / "test_grouped.py").write_text(
        "import pytest\n"
        "GROUPED = [pytest.param(i, marks=pytest.mark.xdist_group('g')) for i in range(6)]\n"
        "@pytest.mark.parametrize('i', GROUPED)\n"
        "def test_one(i):\n"
        "    pass\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v",
                          "-p", "no:cacheprovider", "-o", "addopts=", str(tmp_path / "test_grouped.py")],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:]
    workers = set(re.findall(r"\[(gw\d+)\].*PASSED", run.stdout))
    assert len(workers) == 1, f"one group ran on workers {sorted(workers)}: --dist loadgroup does not group"
