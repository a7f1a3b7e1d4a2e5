"""Fixtures of the hub test: a class made and served by `make hub` (system users, nbgrader's exchange,
JupyterHub and its proxy), and Chromium with a browser context per user.

Whatever the test does or however it fails, the hub is stopped and the class removed when it ends,
and the test fails if any process of the hub or of the class's users survives, if one of the hub's
ports is still taken, if anything the class's users made is left in /tmp, /var/tmp or /dev/shm, or if
the repository's permissions are not what they were before.

The hub runs with either exchange (the `hub` fixture's parameter: "filesystem", the default, or
"ngshare"), with small limits so that the bombs of the test reach them quickly: 2 GiB per user's server
(DPCOURSE_HUB_MEM_LIMIT) and per graded submission (DPCOURSE_SANDBOX_MEMORY).
"""

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "lab"))  # the browser tests' helpers (the package `browser`)
sys.path.insert(0, str(REPO / "hub"))  # run_as: a command as a user of the class, as the hub runs it

from browser.conftest import (  # noqa: E402
    CHROMIUM_ARGS,
    VIEWPORT,
    WAIT,
    chromium,  # noqa: F401 - a fixture, used here
    descendants,
    free_port,
    pytest_runtest_makereport,  # noqa: F401 - the hook that lets fixtures tell a failed test
    reap,
    shots,  # noqa: F401 - a fixture, used here
)

# The hub test's own bounded waits, besides the browser tests' (WAIT), in seconds.
HUB_WAIT = {
    "hub": 90,        # `make hub` makes the class and its hub answers
    "spawn": 120,     # a user logs in: their server starts and JupyterLab loads
    "exchange": 60,   # a click that goes through nbgrader: fetch, submit, release, collect, feedback
    "command": 120,   # an nbgrader command run as a user of the class
}
HUB_WAIT.update({k: v for k, v in WAIT.items() if k not in HUB_WAIT})

# The class: names no real user has (setup_class.py refuses to touch a user it did not make).
INSTRUCTOR = "dpchub-teacher"
STUDENTS = {
    "a": "dpchub-a",  # solves my_slice in the browser, validates, submits
    "b": "dpchub-b",  # submits the released notebook unchanged (browser)
    "c": "dpchub-c",  # submits twice (the latest counts), then once more after the due date
    "d": "dpchub-d",  # submits a notebook that is not one
    "e": "dpchub-e",  # never submits
    "f": "dpchub-f",  # submits, submits again, then puts a link to the solutions in place of that notebook
    "g": "dpchub-g",  # submits, then puts a FIFO in place of their notebook
    "h": "dpchub-h",  # a fork bomb in my_slice
    "j": "dpchub-j",  # a memory bomb in my_slice
}
STAFF = "dpchub-staff"
EXCHANGE_USER = "dpchub-exchange"  # ngshare's (EXCHANGE=ngshare)
LIMITS = {"DPCOURSE_HUB_MEM_LIMIT": "2G", "DPCOURSE_SANDBOX_MEMORY": str(2 << 30)}
SCRATCH = ("/tmp", "/var/tmp", "/dev/shm")


def repository_modes():
    """{entry: (mode, gid)} of the repository's top-level entries."""
    return {p.name: (p.lstat().st_mode, p.lstat().st_gid) for p in REPO.iterdir()}


def class_processes(uids):
    """{pid: command line} of every live process owned by one of `uids`."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid not in uids:
                continue
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                found[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
    return found


def port_taken(port):
    """True if a server could not listen on `port` now (connections closing, TIME_WAIT, do not count)."""
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


class Hub:
    """`make hub` for the test's class, on a free port, in its own session; its log in `log`."""

    def __init__(self, root, log, exchange="filesystem"):
        self.root, self.log, self.port, self.exchange = root, log, free_port(), exchange
        self.url = f"http://localhost:{self.port}"
        self.command = ["make", "-s", "hub", f"HUB_ROOT={root}", f"HUB_INSTRUCTOR={INSTRUCTOR}",
                        f"HUB_STUDENTS={' '.join(STUDENTS.values())}", f"HUB_STAFF={STAFF}",
                        f"HUB_PORT={self.port}", f"EXCHANGE={exchange}", f"HUB_EXCHANGE_USER={EXCHANGE_USER}"]
        self.process, self.timings = None, {}

    @property
    def klass(self):
        return json.loads((self.root / "hub" / "class.json").read_text())

    @property
    def passwords(self):
        return json.loads((self.root / "hub" / "passwords.json").read_text())

    def home(self, user):
        return Path(pwd.getpwnam(user).pw_dir)

    def start(self):
        started = time.monotonic()
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(self.command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True, env={**os.environ, **LIMITS})
        deadline = started + HUB_WAIT["hub"]
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/hub/api/", timeout=5):
                    break
            except OSError:
                if self.process.poll() is not None:
                    pytest.fail(f"`make hub` exited with {self.process.returncode} before its hub answered; "
                                f"its log ({self.log}) ends:\n{self.log_tail()}", pytrace=False)
                if time.monotonic() > deadline:
                    pytest.fail(f"the hub did not answer on port {self.port} within {HUB_WAIT['hub']} s; "
                                f"its log ends:\n{self.log_tail()}", pytrace=False)
                time.sleep(0.2)
        self.timings["make hub until it answers"] = time.monotonic() - started
        self.timings.update(self.log_timings())
        return self

    def log_timings(self):
        """The setup's duration, as setup_class.py prints it ("class ready in X s")."""
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith("class ready in "):
                return {"setup_class.py": float(line.split()[3])}
        return {}

    def internal_ports(self):
        """The hub's API and the proxy's API ports, read from the hub's log."""
        ports = []
        for line in self.log.read_text(errors="replace").splitlines():
            for marker in ("Hub API listening on http://127.0.0.1:", "Proxy API at http://127.0.0.1:"):
                if marker in line:
                    ports.append(int(line.split(marker)[1].split("/")[0]))
        return ports

    def log_tail(self, lines=30):
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self):
        """SIGTERM to `make hub` (the hub stops its servers and proxy); returns what had to be killed."""
        if self.process is None:
            return {}
        tree = descendants(self.process.pid)
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=HUB_WAIT["stop"] * 3)  # each server gets up to 10 s (interrupt_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        return reap(tree, HUB_WAIT["stop"])

    def run_as(self, user, *command, input=None, token=None):
        """An nbgrader (or any) command as `user` of the class, as their server would run it; with ngshare,
        `token` is the JupyterHub API token the exchange's requests carry (their server's: server_token)."""
        from run_as import run

        extra = ["env", f"JUPYTERHUB_API_TOKEN={token}", f"JUPYTERHUB_USER={user}"] if token else []
        proc = run(self.root, user, [*extra, *command], input=input, capture_output=True, text=True,
                   timeout=HUB_WAIT["command"])
        return proc

    def server_pid(self, user):
        """The pid of `user`'s running JupyterLab server (jupyterhub-singleuser), or None."""
        uid = pwd.getpwnam(user).pw_uid
        for pid, command in class_processes({uid}).items():
            if "jupyterhub-singleuser" in command:
                return pid
        return None

    def server_token(self, user):
        """The JupyterHub API token of `user`'s running server (what their nbgrader extensions send ngshare),
        read from its environment as root: the command-line steps then act exactly as that server."""
        pid = self.server_pid(user)
        assert pid, f"{user}'s server is not running"
        with open(f"/proc/{pid}/environ", "rb") as f:
            variables = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        return variables[b"JUPYTERHUB_API_TOKEN"].decode()


def left_in_scratch(uids):
    """The entries of /tmp, /var/tmp and /dev/shm owned by one of `uids`."""
    found = []
    for folder in SCRATCH:
        for entry in os.scandir(folder):
            try:
                if entry.stat(follow_symlinks=False).st_uid in uids:
                    found.append(entry.path)
            except OSError:
                continue
    return found


@pytest.fixture
def hub(request, shots):  # noqa: F811 - shots is the browser tests' fixture
    """The class on a running hub (make hub), removed afterwards; see the module docstring. Parametrize
    it indirectly with "ngshare" for the exchange as a service."""
    if os.geteuid() != 0:
        pytest.skip("the hub test creates system users and starts servers as them: run it as root "
                    "(make test as root, as CI does)")
    before = repository_modes()
    root = Path(tempfile.mkdtemp(prefix="dpcourse-hub-test-"))
    os.chmod(root, 0o755)
    hub = Hub(root, shots.folder / "hub.log", getattr(request, "param", "filesystem"))
    problems = []
    try:
        yield hub.start()
    finally:
        uids = set()
        for user in [INSTRUCTOR, *STUDENTS.values(), EXCHANGE_USER]:
            try:
                uids.add(pwd.getpwnam(user).pw_uid)
            except KeyError:
                pass
        killed = hub.stop()
        if killed:
            problems.append(f"processes of the hub outlived it (killed now): {killed}")
        left = class_processes(uids)
        if left:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            problems.append(f"processes of the class's users outlived the hub (killed now): {left}")
        taken = [p for p in [hub.port, *hub.internal_ports()] if port_taken(p)]
        if taken:
            problems.append(f"ports of the hub still taken after it stopped: {taken}")
        removed = subprocess.run(["make", "-s", "hub-remove", f"HUB_ROOT={root}"], cwd=REPO,
                                 capture_output=True, text=True, timeout=60)
        if removed.returncode:
            problems.append(f"make hub-remove failed: {removed.stdout}{removed.stderr}")
        shutil.rmtree(root, ignore_errors=True)
        scratch = left_in_scratch(uids)
        if scratch:
            problems.append(f"the class's users left files in the machine's scratch folders: {scratch}")
        changed = {k: v for k, v in repository_modes().items() if before.get(k, v) != v}
        if changed:
            problems.append(f"the repository's permissions differ from before the class: {changed}")
        timings = shots.folder / "timings.json"
        timings.write_text(json.dumps(hub.timings, indent=1))
    assert not problems, "\n".join(problems)


@pytest.fixture
def browser(request, chromium, shots):  # noqa: F811 - chromium is the browser tests' fixture
    """One headless Chromium; `browser.new_context()` per user (each its own cookies). On failure, a
    last screenshot of every open page (failed-N.png)."""
    from playwright.sync_api import sync_playwright

    before = set(descendants(os.getpid()))
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS,
                                             timeout=HUB_WAIT["browser"] * 1000)
        processes = {pid: cmd for pid, cmd in descendants(os.getpid()).items() if pid not in before}
        try:
            yield browser
            if getattr(request.node, "report_call", None) and request.node.report_call.failed:
                pages = [page for context in browser.contexts for page in context.pages]
                for n, page in enumerate(pages):
                    page.screenshot(path=str(shots.folder / f"failed-{n}.png"))
        finally:
            browser.close()
    left = reap(processes, HUB_WAIT["stop"])
    assert not left, f"browser processes outlived the browser (killed now): {left}"


def new_page(browser):
    """A page in a fresh browser context (a user's own cookies), the size of the browser tests'."""
    page = browser.new_context(viewport=VIEWPORT).new_page()
    page.set_default_timeout(HUB_WAIT["step"] * 1000)
    return page
