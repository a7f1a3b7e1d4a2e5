"""A cgroup per user's server on a shared machine: CPU, memory and processes (what systemdspawner gives
where systemd runs; here the hub's spawner makes it itself, as root).

    group = UserCgroup("student-a", memory=2 << 30, cpus=2.0, pids=1024)
    group.create()             # as root, before the server starts
    preexec: group.join()      # the server's first process, before it becomes its user: every kernel,
                               # terminal and rank it starts is in the cgroup from its first instruction
    group.oom_kills()          # how many processes the kernel killed for reaching the memory limit
    group.kill_all(); group.remove()   # when the server stops: nothing of the user's is left running

The limits are per user, not per process: a student's kernel and the 2-8 ranks it forks share their
server's memory and CPU. When they reach the memory limit the kernel's OOM killer kills the largest
process of that cgroup (the kernel, or a rank, that allocated), never a process of another user, and the
server goes on (JupyterLab says the kernel died and restarts it). cgroup v1 (these machines:
/sys/fs/cgroup/{memory,cpu,pids}) and v2 (one unified tree; the controllers must be enabled for
/sys/fs/cgroup's children, as systemd does) are both handled; only v1 is exercised by the tests here.
"""

import os
import signal
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PARENT = "dpcourse-hub"
PERIOD_US = 100_000


def unified():
    return (ROOT / "cgroup.controllers").exists()


class UserCgroup:
    def __init__(self, user, memory=None, cpus=None, pids=None):
        self.user, self.memory, self.cpus, self.pids = user, memory, cpus, pids
        if unified():
            self.paths = {"unified": ROOT / PARENT / user}
        else:
            self.paths = {c: ROOT / c / PARENT / user for c in ("memory", "cpu", "pids")
                          if (ROOT / c).is_dir()}

    def settings(self):
        """{controller: {file: value}} for the limits asked for."""
        memory, cpu, pids = {}, {}, {}
        if unified():
            if self.memory:
                memory.update({"memory.max": self.memory, "memory.swap.max": 0})
            if self.cpus:
                cpu["cpu.max"] = f"{int(self.cpus * PERIOD_US)} {PERIOD_US}"
            if self.pids:
                pids["pids.max"] = self.pids
            return {"unified": {**memory, **cpu, **pids}}
        if self.memory:  # memsw (memory + swap) after memory: it may never be below it
            memory.update({"memory.limit_in_bytes": self.memory, "memory.memsw.limit_in_bytes": self.memory})
        if self.cpus:
            cpu.update({"cpu.cfs_period_us": PERIOD_US, "cpu.cfs_quota_us": int(self.cpus * PERIOD_US)})
        if self.pids:
            pids["pids.max"] = self.pids
        return {"memory": memory, "cpu": cpu, "pids": pids}

    def create(self):
        """Make the cgroup (emptied of any process a previous server left) and set its limits. Raises
        OSError where this process may not (not root, no cgroup file system)."""
        if unified():
            parent = ROOT / PARENT
            parent.mkdir(exist_ok=True)
            for folder in (ROOT, parent):  # the controllers, for the children of each
                wanted = {"memory", "cpu", "pids"} & set((folder / "cgroup.controllers").read_text().split())
                (folder / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in sorted(wanted)))
        self.kill_all()
        for controller, settings in self.settings().items():
            path = self.paths.get(controller)
            if path is None:
                continue
            path.mkdir(parents=True, exist_ok=True)
            for name, value in settings.items():
                if (path / name).exists():
                    (path / name).write_text(str(value))

    def join(self, pid=None):
        """Put `pid` (default: this process) in the cgroup; in a preexec_fn, before exec."""
        for path in self.paths.values():
            (path / "cgroup.procs").write_text(str(pid or os.getpid()))

    def processes(self):
        found = set()
        for path in self.paths.values():
            try:
                found.update(int(p) for p in (path / "cgroup.procs").read_text().split())
            except OSError:
                continue
        return found

    def kill_all(self, timeout=5.0):
        """SIGKILL every process in the cgroup until none is left (a fork racing the kill: next round)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            left = self.processes()
            if not left:
                return True
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.02)
        return False

    def oom_kills(self):
        """How many of the cgroup's processes the kernel killed for reaching its memory limit."""
        if unified():
            name, path = "memory.events", self.paths["unified"]
        else:
            name, path = "memory.oom_control", self.paths.get("memory")
        try:
            lines = dict(line.split() for line in (path / name).read_text().splitlines())
            return int(lines.get("oom_kill", 0))
        except (OSError, TypeError, ValueError):
            return 0

    def memory_peak(self):
        """The most memory the cgroup's processes held at once, in bytes (None where not kept)."""
        path, name = ((self.paths["unified"], "memory.peak") if unified()
                      else (self.paths.get("memory"), "memory.max_usage_in_bytes"))
        try:
            return int((path / name).read_text())
        except (OSError, TypeError, ValueError):
            return None

    def remove(self):
        for path in self.paths.values():
            for _ in range(100):  # a killed process leaves its cgroup a moment after it dies
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)
