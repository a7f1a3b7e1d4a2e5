"""The class's grading service: every judge of the class runs here, as root, so that grading on the hub
has the same per-submission limits as `make autograde` run by root (issue 28).

    python hub/grading_service.py --root HUB_ROOT     # what the hub starts (a managed JupyterHub service)

Why a service, and not a privilege for the instructor: what isolates one submission from every other
(a pid namespace, a cgroup with a process and a memory limit, user ids drawn fresh for its ranks) needs
root, and the instructor's server runs as the instructor. A grader run with sudo, or with the
capabilities the judge keeps (sandbox.JUDGE_CAPABILITIES: mounts, setuid, cgroups), would hand those
powers to whatever runs as the instructor: their terminal, their kernels, and anything a submission
does to them. Here the instructor can ask one thing only: "judge this notebook against the solution of
this assignment". The service takes the notebook's bytes over its socket (it never opens a path the
instructor names), judges it against the repository's own solutions/ with dpgrader's JudgeWorker
exactly as `make autograde` does as root (fresh pid namespace, cgroup and user ids per submission, the
judge in its own sandbox and memory cgroup), and answers with the verdicts; recording them in the
gradebook, feedback and grades.csv stay with the instructor, as the instructor (hub/grading_client.py).

Who may ask: the class's instructor only (the socket's peer credentials, SO_PEERCRED), through
HUB_ROOT/grading/judge.sock (root:STAFF, 0660, in a folder 0750). One connection is one judge worker
(autograde.py's JOBS workers are JOBS connections), at most MAX_WORKERS at once. Each request is one
line of JSON, answered by one line:
    {"assignment": "04_ring_allreduce", "student": "ada", "notebook": "<the .ipynb's text>",
     "timeout": 900, "budget": 120, "budget_why": "..."}   ->  {"verdicts": {...}}   (or {"error": "..."})
    {"restart": true}                                       ->  {"restarted": true}
Every job is logged with the student it was asked for (the hub's log), so a submission that reached its
limits is named there as well as in its verdicts.
"""

import argparse
import grp
import json
import os
import pwd
import re
import signal
import socket
import socketserver
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "autograder"))  # dpgrader

MAX_NOTEBOOK = 64 << 20  # bytes of one submission's notebook
MAX_WORKERS = 8
MAX_TIMEOUT = 900  # seconds one judging may take, whatever is asked (autograde.PER_SUBMISSION_TIMEOUT)
ASSIGNMENT = re.compile(r"^[A-Za-z0-9_.-]+$")


def log(message):
    print(f"[grading service] {time.strftime('%H:%M:%S')} {message}", flush=True)


def peer_uid(connection):
    pid, uid, gid = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              struct.calcsize("3i")))
    return uid


def source_of(assignment):
    """The instructor's notebook of an assignment, from the repository's solutions/ (never a path given)."""
    if not isinstance(assignment, str) or not ASSIGNMENT.match(assignment) or assignment.startswith("."):
        raise ValueError(f"no such assignment: {assignment!r}")
    notebooks = sorted((REPO / "solutions" / assignment).glob("*.ipynb"))
    if not notebooks:
        raise ValueError(f"no such assignment in solutions/: {assignment!r}")
    return notebooks[0]


class Handler(socketserver.StreamRequestHandler):
    """One connection: one JudgeWorker (as root: each submission isolated from every other)."""

    def handle(self):
        server = self.server
        uid = peer_uid(self.connection)
        if uid not in server.allowed:
            log(f"refused a connection from uid {uid} (only the instructor may ask for grading)")
            return self._send({"error": "only the class's instructor may ask the grading service"})
        if not server.slots.acquire(blocking=False):
            return self._send({"error": f"the grading service judges at most {MAX_WORKERS} at once"})
        from dpgrader.judge.process import JudgeWorker

        try:
            with tempfile.TemporaryDirectory(prefix="dpcourse-grading-") as folder, \
                    JudgeWorker(sandboxed=True) as worker:
                server.workers.add(worker)
                try:
                    self._serve(worker, Path(folder))
                finally:
                    server.workers.discard(worker)
        finally:
            server.slots.release()

    def _serve(self, worker, folder):
        while True:
            line = self.rfile.readline(MAX_NOTEBOOK + (1 << 16))
            if not line:
                return
            if not line.endswith(b"\n"):
                return self._send({"error": f"a request may hold at most {MAX_NOTEBOOK >> 20} MiB"})
            try:
                request = json.loads(line)
                if request.get("restart"):
                    worker.restart()
                    self._send({"restarted": True})
                    continue
                self._send(self._judge(worker, folder, request))
            except (ValueError, TypeError, AttributeError) as exc:
                self._send({"error": f"bad request: {exc}"})

    def _judge(self, worker, folder, request):
        source = source_of(request.get("assignment"))
        student = str(request.get("student") or "")[:100] or None
        notebook = request.get("notebook")
        if not isinstance(notebook, str):
            raise ValueError("no notebook given")
        submission = folder / "submission.ipynb"
        submission.write_text(notebook)
        timeout = min(float(request.get("timeout") or MAX_TIMEOUT), MAX_TIMEOUT)
        budget = request.get("budget")
        budget = min(float(budget), MAX_TIMEOUT) if budget else None
        started = time.monotonic()
        verdicts = worker.judge(source, submission, timeout=timeout, owner=student, budget=budget,
                                budget_why=str(request.get("budget_why") or "")[:300])
        took = time.monotonic() - started
        who = f"{student or '(no student named)'}/{source.parent.name}"
        if "error" in verdicts:
            log(f"{who}: not judged after {took:.0f} s: {verdicts['error'].splitlines()[0][:200]}")
        else:
            reached = verdicts.get("_limits_reached") or {}
            failed = sum(1 for k, v in verdicts.items() if not k.startswith("_") and not v.get("passed"))
            limits = ", ".join(f"{k} limit reached {n} times" for k, n in reached.items() if n)
            log(f"{who}: judged in {took:.0f} s, {failed} cells failed" + (f"; {limits}" if limits else ""))
        return {"verdicts": verdicts}

    def _send(self, reply):
        try:
            self.wfile.write(json.dumps(reply).encode() + b"\n")
            self.wfile.flush()
        except OSError:
            pass


class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path, allowed):
        self.allowed, self.workers = allowed, set()
        self.slots = threading.BoundedSemaphore(MAX_WORKERS)
        super().__init__(str(path), Handler)

    def close_workers(self):
        for worker in list(self.workers):
            try:
                worker.close()
            except Exception:  # noqa: BLE001 - shutting down: every judge must go, whatever one raised
                pass


def serve(root):
    klass = json.loads((root / "hub" / "class.json").read_text())
    path = Path(klass["grading_socket"])
    folder = path.parent
    staff = grp.getgrnam(klass["staff_group"]).gr_gid
    folder.mkdir(mode=0o750, exist_ok=True)
    os.chown(folder, 0, staff)
    os.chmod(folder, 0o750)
    if path.exists() or path.is_symlink():
        path.unlink()
    server = Server(path, allowed={pwd.getpwnam(klass["instructor"]).pw_uid})
    os.chown(path, 0, staff)
    os.chmod(path, 0o660)

    def stop(signum, frame):
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log(f"judging for {klass['instructor']} at {path}, as root: each submission in a pid namespace, cgroup "
        f"and user ids of its own")
    try:
        server.serve_forever()
    finally:
        server.close_workers()
        server.server_close()
        path.unlink(missing_ok=True)
        log("stopped")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, required=True, help="the class's folder (make hub's HUB_ROOT)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("the grading service isolates submissions as only root can: run it as root", file=sys.stderr)
        return 1
    serve(args.root.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
