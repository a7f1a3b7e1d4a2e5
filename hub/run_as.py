"""Run a command as a user of the class, as their server would run it (for admins, and the hub's test).

    sudo .venv/bin/python hub/run_as.py --root /srv/dpcourse-hub student-a -- nbgrader list
    sudo .venv/bin/python hub/run_as.py --root /srv/dpcourse-hub instructor -- make -C /path/to/repo autograde

The same user, groups, home, environment and view of the course's Python as their server
(hub/spawner.py), without JupyterHub. Exits with the command's status.
"""

import argparse
import json
import os
import pwd
import subprocess
import sys
from pathlib import Path

from spawner import environment, preexec_for


def command_env(klass, name):
    user = pwd.getpwnam(name)
    venv = os.path.join(os.path.abspath(sys.prefix), "bin")  # the course's, as the hub's PATH has it first
    path = os.pathsep.join([venv, os.environ.get("PATH", os.defpath)])
    return {"PATH": path, "HOME": user.pw_dir, "USER": name,
            "SHELL": user.pw_shell, "LANG": os.environ.get("LANG", "C.UTF-8"),
            **environment(klass, name)}


def run(root, name, command, **popen):
    """subprocess.run of `command` as `name` of the class made under `root`."""
    klass = json.loads((Path(root) / "hub" / "class.json").read_text())
    return subprocess.run(command, env=command_env(klass, name), preexec_fn=preexec_for(name), **popen)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, required=True, help="the class's folder (make hub's HUB_ROOT)")
    parser.add_argument("user")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    return run(args.root, args.user, command).returncode


if __name__ == "__main__":
    sys.exit(main())
