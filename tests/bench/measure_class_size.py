"""What one student and one submission cost, measured: the inputs of the class's sizing on paper
(README, "A class on Kubernetes"). As root (each measurement in a cgroup of its own).

    sudo .venv/bin/python tests/bench/measure_class_size.py                 # every notebook, then grading
    sudo .venv/bin/python tests/bench/measure_class_size.py --only 12 --learners 0

Per notebook: a learner's kernel runs every cell of the notebook, solved (the instructor's notebook
with its hidden tests taken out: what a learner who did every exercise runs, demos included), in a
cgroup of its own (memory, cpuacct): its peak memory (memory.max_usage_in_bytes: the kernel and every
rank it forked, shared mappings included), the CPU time used (cpuacct.usage) and the wall time. Once:
an idle JupyterLab server's memory, which every student's server adds.
Grading: `autograde.py` (JOBS=2, as root: the class's path) on --learners learners who each submitted
every notebook, in a cgroup: CPU seconds per submission (judge, ranks, nbgrader) and wall time.
CPU seconds do not depend much on what else runs on the machine; wall time does (the load is printed).
Nothing is asserted: this is a measurement (make bench's rule).
"""

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[2]
CGROUPS = Path("/sys/fs/cgroup")
HIDDEN = re.compile(r"### BEGIN HIDDEN TESTS.*?### END HIDDEN TESTS\n?", re.S)


class Measured:
    """A memory + cpuacct cgroup (v1) for one measurement."""

    def __init__(self):
        name = f"dpcourse-measure-{uuid.uuid4().hex[:8]}"
        self.memory, self.cpu = CGROUPS / "memory" / name, CGROUPS / "cpuacct" / name
        for path in (self.memory, self.cpu):
            path.mkdir()

    def join_command(self):
        """Shell that moves itself into the cgroup, then execs the rest of the command line."""
        return (f"echo $$ > {self.memory}/cgroup.procs && echo $$ > {self.cpu}/cgroup.procs && "
                f'exec "$@"')

    def peak_bytes(self):
        return int((self.memory / "memory.max_usage_in_bytes").read_text())

    def current_bytes(self):
        return int((self.memory / "memory.usage_in_bytes").read_text())

    def cpu_seconds(self):
        return int((self.cpu / "cpuacct.usage").read_text()) / 1e9

    def close(self):
        for path in (self.memory, self.cpu):
            for pid in (path / "cgroup.procs").read_text().split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for _ in range(200):
                try:
                    path.rmdir()
                    break
                except OSError:
                    time.sleep(0.05)


def learner_notebook(assignment):
    """The instructor's notebook of `assignment` with its hidden tests removed (a solved learner's)."""
    nb = nbformat.read(next((REPO / "solutions" / assignment).glob("*.ipynb")), as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.source = HIDDEN.sub("", cell.source)
    return nb


def kernelspec(folder, group):
    """A kernel whose process starts inside `group` (so do the ranks it forks)."""
    spec = folder / "kernels" / "measured"
    spec.mkdir(parents=True, exist_ok=True)
    argv = ["sh", "-c", group.join_command(), "sh", sys.executable, "-m", "ipykernel_launcher", "-f",
            "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "measured",
                                                   "language": "python"}))
    return folder


def run_notebook(assignment, timeout):
    from nbclient import NotebookClient

    group = Measured()
    folder = Path(tempfile.mkdtemp(prefix="dpcourse-measure-"))
    try:
        os.environ["JUPYTER_PATH"] = str(kernelspec(folder, group))
        nb = learner_notebook(assignment)
        started = time.monotonic()
        client = NotebookClient(nb, kernel_name="measured", timeout=timeout, allow_errors=True,
                                resources={"metadata": {"path": str(REPO / "course" / assignment)}})
        client.execute()
        wall = time.monotonic() - started
        errors = [o.get("ename") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                  if o.get("output_type") == "error"]
        return {"assignment": assignment, "peak_mib": group.peak_bytes() / 2**20,
                "cpu_s": group.cpu_seconds(), "wall_s": wall, "errors": errors}
    finally:
        group.close()
        shutil.rmtree(folder, ignore_errors=True)


def idle_server_mib():
    """The memory of a JupyterLab server that has started and answers (no kernel yet)."""
    group = Measured()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    home = Path(tempfile.mkdtemp(prefix="dpcourse-measure-lab-"))
    command = ["sh", "-c", group.join_command(), "sh", str(Path(sys.executable).parent / "jupyter"), "lab",
               "--no-browser", f"--port={port}", "--allow-root", f"--ServerApp.root_dir={home}",
               "--IdentityProvider.token=", "--ServerApp.password="]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        import urllib.request

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        urllib.request.urlopen(f"http://127.0.0.1:{port}/lab", timeout=30).read()  # JupyterLab's page
        time.sleep(2)
        return group.current_bytes() / 2**20, group.peak_bytes() / 2**20
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        group.close()
        shutil.rmtree(home, ignore_errors=True)


def grading(learners, jobs):
    """CPU seconds and wall seconds of autograde.py on `learners` x every notebook (as root)."""
    root = Path(tempfile.mkdtemp(prefix="dpcourse-measure-class-", dir="/var/tmp"))
    group = Measured()
    try:
        (root / "solutions").symlink_to(REPO / "solutions")
        assignments = sorted(p.name for p in (REPO / "solutions").glob("[0-9]*") if p.is_dir())
        for learner in range(learners):
            for assignment in assignments:
                folder = root / "autograder" / "submitted" / f"learner{learner}" / assignment
                folder.mkdir(parents=True)
                shutil.copy(next((REPO / "solutions" / assignment).glob("*.ipynb")), folder)
        env = dict(os.environ, DPCOURSE_COURSE_ROOT=str(root),
                   DPCOURSE_DB_URL=f"sqlite:///{root / 'gradebook.db'}")
        # the solutions' judge times (the budgets) first, outside the figures, as a class's second run
        subprocess.run([sys.executable, str(REPO / "autograder" / "autograde.py"), "--jobs", str(jobs),
                        "--student", "learner0"], env=env, capture_output=True, text=True, timeout=7200)
        before = group.cpu_seconds()
        started = time.monotonic()
        proc = subprocess.run(["sh", "-c", group.join_command(), "sh", sys.executable,
                               str(REPO / "autograder" / "autograde.py"), "--jobs", str(jobs)],
                              env=env, capture_output=True, text=True, timeout=14400)
        wall = time.monotonic() - started
        submissions = learners * len(assignments)
        return {"submissions": submissions, "cpu_s": group.cpu_seconds() - before, "wall_s": wall,
                "exit": proc.returncode, "tail": proc.stdout[-400:]}
    finally:
        group.close()
        shutil.rmtree(root, ignore_errors=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="assignment numbers (00 01 ...)")
    parser.add_argument("--learners", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=900, help="seconds a cell may take")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("measurements use cgroups: run as root", file=sys.stderr)
        return 1
    print(f"load before: {os.getloadavg()}")
    assignments = sorted(p.name for p in (REPO / "solutions").glob("[0-9]*") if p.is_dir())
    if args.only is not None:
        assignments = [a for a in assignments if a[:2] in args.only]
    if assignments:
        current, peak = idle_server_mib()
        print(f"idle JupyterLab server: {current:.0f} MiB (peak while starting {peak:.0f} MiB)")
    rows = []
    for assignment in assignments:
        row = run_notebook(assignment, args.timeout)
        rows.append(row)
        print(f"{assignment:<28} peak {row['peak_mib']:7.0f} MiB  cpu {row['cpu_s']:7.1f} s  wall "
              f"{row['wall_s']:7.1f} s  ({row['cpu_s'] / row['wall_s']:.2f} cores while running)  "
              f"errors: {sorted(set(row['errors'])) or 'none'}", flush=True)
    if rows:
        heaviest = max(rows, key=lambda r: r["peak_mib"])
        print(f"heaviest by memory: {heaviest['assignment']} ({heaviest['peak_mib']:.0f} MiB); by CPU: "
              f"{max(rows, key=lambda r: r['cpu_s'])['assignment']}")
    if args.learners:
        g = grading(args.learners, args.jobs)
        print(f"grading {g['submissions']} submissions (JOBS={args.jobs}, as root): cpu {g['cpu_s']:.0f} s "
              f"({g['cpu_s'] / g['submissions']:.1f} s per submission), wall {g['wall_s']:.0f} s "
              f"({g['wall_s'] / g['submissions']:.1f} s per submission); exit {g['exit']}")
        if g["exit"]:
            print(g["tail"])
    print(f"load after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
