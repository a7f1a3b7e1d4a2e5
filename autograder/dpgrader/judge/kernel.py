"""The Jupyter kernel nbgrader runs a submission in while grading: IPython inside the sandbox.

    python -m dpgrader.judge.kernel CONNECTION_FILE      # the kernelspec's argv (see kernelspec())

The submission's own cells (not its test cells: the judge runs those) execute here, for the
learner's feedback. The kernel sees what every grading sandbox sees (dpgrader.judge.sandbox:
the OS, the Python environment, the released course; a private /tmp; no capabilities) plus
its connection file, read-only. It keeps the host's loopback network, which is how nbgrader's
client reaches it; every process it starts lives in its pid namespace and dies with it, so a
daemon cannot outlive the notebook or keep its ports.
"""

import json
import os
import sys
from pathlib import Path

from dpgrader.judge import sandbox

KERNEL_NAME = "dpcourse-sandbox"
HIDDEN_ENVIRONMENT = ("DPCOURSE_COURSE_ROOT", "DPCOURSE_DB_URL", "NBGRADER_EXECUTION", "JUPYTER_PATH",
                      "JPY_SESSION_NAME", "PYTHONPATH")


def kernelspec(folder):
    """Write the kernelspec under folder/kernels/; put `folder` on JUPYTER_PATH to use it."""
    spec = folder / "kernels" / KERNEL_NAME
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [os.path.abspath(sys.executable), "-m", "dpgrader.judge.kernel", "{connection_file}"],
        "display_name": "Python 3 (grading sandbox)", "language": "python"}))
    return folder


def main():
    connection = Path(sys.argv[1]).resolve()
    command = [os.path.abspath(sys.executable), "-m", "ipykernel_launcher", "-f", str(connection),
               "--HistoryManager.hist_file=:memory:"]
    env = {k: v for k, v in os.environ.items() if k not in HIDDEN_ENVIRONMENT}
    env["DPCOURSE_SANDBOXED"] = "1"
    cgroup = sandbox.Cgroup()
    cgroup.add(os.getpid())
    sandbox.set_rlimits()
    os.execvpe("bwrap", sandbox.argv(command, binds=[(connection, False)], network=True), env)


if __name__ == "__main__":
    main()
