"""The Jupyter kernel nbgrader runs a submission in while grading: IPython inside the sandbox.

    python -m dpgrader.judge.kernel CONNECTION_FILE      # the kernelspec's argv (see kernelspec())

The submission's own cells (not its test cells: the judge runs those) execute here, for the
learner's feedback. The kernel sees what every grading sandbox sees (dpgrader.judge.sandbox:
the OS, the Python environment, the released course; a private /tmp) plus a copy of its
connection file, read-only; it runs as a fresh unprivileged user, with no capabilities and an
environment that holds nothing of the grader's. It keeps the host's loopback network, which is how nbgrader's
client reaches it; every process it starts lives in its pid namespace and dies with it, so a
daemon cannot outlive the notebook or keep its ports.
"""

import json
import os
import sys
import tempfile
from pathlib import Path

from dpgrader.judge import sandbox

KERNEL_NAME = "dpcourse-sandbox"


def kernelspec(folder):
    """Write the kernelspec under folder/kernels/; put `folder` on JUPYTER_PATH to use it."""
    spec = folder / "kernels" / KERNEL_NAME
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [os.path.abspath(sys.executable), "-m", "dpgrader.judge.kernel", "{connection_file}"],
        "display_name": "Python 3 (grading sandbox)", "language": "python"}))
    return folder


def main():
    """Exec bwrap: the kernel runs inside as a fresh unprivileged user (root without capabilities
    could still read root's own files), with an allow-listed environment, reading a copy of its
    connection file that this user owns."""
    connection = Path(sys.argv[1]).resolve()
    uid = sandbox.new_uid_block()
    # named after this process, which becomes the kernel's sandbox (exec keeps the pid): its folder is
    # stale once no process has that pid (see _remove_stale_copies)
    folder = Path(tempfile.mkdtemp(prefix=f"dpcourse-kernel-{os.getpid()}-"))
    copy = folder / "connection.json"
    copy.write_bytes(connection.read_bytes())
    for path in (folder, copy):
        os.chown(path, uid, uid)
    os.chmod(copy, 0o400)
    command = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
               "--bounding-set=-all", "--no-new-privs", "--",
               os.path.abspath(sys.executable), "-m", "ipykernel_launcher", "-f", str(copy),
               "--HistoryManager.hist_file=:memory:"]
    cgroup = sandbox.Cgroup()
    cgroup.add(os.getpid())
    sandbox.set_rlimits()
    # the copy's folder goes with the kernel: removed by the next kernel's start (see remove_stale)
    _remove_stale_copies(folder)
    os.execvpe("bwrap", sandbox.argv(command, binds=[(folder, False)], network=True, keep_capabilities=True),
               sandbox.environment(DPCOURSE_SANDBOXED="1"))


def _remove_stale_copies(keep):
    """Connection-file copies of kernels that ended: the process each folder is named after (the kernel's
    sandbox, dpcourse-kernel-<pid>-...) is gone. Not "its owner has no process left": between making its
    folder and starting as that owner, a kernel starting at the same time (JOBS=2 with
    DPCOURSE_RUN_KERNEL=1) has no process of that owner yet, and its folder would be taken from it."""
    import shutil

    for old in Path(tempfile.gettempdir()).glob("dpcourse-kernel-*"):
        pid = old.name.split("-")[2]
        if old == keep or (pid.isdigit() and os.path.exists(f"/proc/{pid}")):
            continue
        shutil.rmtree(old, ignore_errors=True)


if __name__ == "__main__":
    main()
