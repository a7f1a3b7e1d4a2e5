"""Fixtures of the browser tests: JupyterLab started the way people start it (`make lab`,
`make formgrader`), Chromium driven by Playwright, a folder of screenshots per test.

Whatever a test does or however it fails, its server, the server's kernels (and their ranks) and the
browser are stopped when it ends, and the test fails if any of their processes survive.

Playwright rather than Selenium: its pip wheel carries its driver (Selenium would need Debian's
chromium-driver, one more machine package), every wait takes a timeout, and an element's screenshot
is one call. It drives the system's Chromium (`executable_path`); `playwright install` is never run.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCREENSHOTS = REPO / "browser-screenshots"  # git-ignored

# Every wait of the suite, in seconds. A wait that runs out fails naming what did not appear.
WAIT = {
    "server": 90,      # `make lab` / `make formgrader` answers on its port
    "browser": 30,     # Chromium starts
    "lab": 60,         # JupyterLab loads: its file browser, a kernel, the Formgrader panel's pages
    "step": 30,        # a click lands: a menu, a file, a notebook tab, a dialog closing
    "cells": 240,      # the cells of a notebook run (each launches several ranks)
    "widget": 60,      # a widget appears, or redraws after its slider moves
    "validate": 240,   # nbgrader's Validate: save, re-run the notebook on the server, show the verdict
    "autograde": 420,  # `make autograde` on the generated submissions
    "stop": 20,        # server, kernels or browser exit once asked
}

CHROMIUM_HELP = (
    "Chromium is not installed and the browser tests need it. Install it once per machine with "
    "`make browser-deps` (as root: runs `apt-get install -y chromium`; elsewhere "
    "`sudo apt-get install -y chromium`), or point DPCOURSE_CHROMIUM at a Chromium or Chrome executable.")

# Headless, and quiet: without the networking flags Chromium keeps calling home, which floods a
# machine without internet access with refused connections. Playwright gives each launch a fresh,
# temporary profile (user-data dir) and removes it on close.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
VIEWPORT = {"width": 1200, "height": 800}

# JupyterLab settings of the test servers: no news pop-up over the notebook, and every cell kept in
# the page (the default windowing detaches cells scrolled out of view, which a test would then miss).
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
}


def descendants(pid):
    """{pid: command line} of every process below `pid`, read from /proc (zombies excluded)."""
    parent, cmd = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                line = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if fields[0] != "Z":
            parent[int(entry)], cmd[int(entry)] = int(fields[1]), line
    found, frontier = {}, [pid]
    while frontier:
        p = frontier.pop()
        for child, ppid in parent.items():
            if ppid == p and child not in found:
                found[child] = cmd[child]
                frontier.append(child)
    return found


def still_running(pids):
    """The pids among `pids` that are still alive (not zombies)."""
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.append(pid)
        except OSError:
            pass
    return alive


def reap(processes, wait):
    """Give `processes` ({pid: cmd}) `wait` seconds to exit, SIGKILL the rest; return the ones killed."""
    deadline = time.monotonic() + wait
    while still_running(processes) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {pid: processes[pid] for pid in still_running(processes)}
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return left


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`make lab` or `make formgrader` on a free loopback port with a token, in its own session."""

    def __init__(self, target, home, log, make_vars=(), env=None):
        self.target, self.home, self.log = target, home, log
        self.port, self.token = free_port(), "dpcourse-browser-test"
        opts = (f"--no-browser --ip=127.0.0.1 --port={self.port} --ServerApp.port_retries=0 "
                f"--IdentityProvider.token={self.token}")
        self.command = ["make", "-s", target, f"LAB_OPTS={opts}", *make_vars]
        self.env = {**os.environ, **(env or {}),
                    "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"),
                    "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"),
                    "JUPYTER_RUNTIME_DIR": str(home / "runtime")}
        self.process = None

    def url(self, path, **query):
        """An address on the server, token included."""
        args = "".join(f"&{k}={v}" for k, v in query.items())
        return f"http://127.0.0.1:{self.port}/{path.lstrip('/')}?token={self.token}{args}"

    def api(self, path, method="GET"):
        request = urllib.request.Request(self.url(path), method=method)
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
        return json.loads(body) if body else None

    def start(self):
        for plugin, values in LAB_SETTINGS.items():
            path = self.home / "settings" / f"{plugin}.jupyterlab-settings"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(self.command, cwd=REPO, env=self.env, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + WAIT["server"]
        while True:
            try:
                self.api("api/status")
                return self
            except OSError:
                if self.process.poll() is not None:
                    pytest.fail(f"`make {self.target}` exited with {self.process.returncode} before "
                                f"serving; its log ({self.log}) ends:\n{self.log_tail()}", pytrace=False)
                if time.monotonic() > deadline:
                    pytest.fail(f"`make {self.target}` did not answer on port {self.port} within "
                                f"{WAIT['server']} s; its log ends:\n{self.log_tail()}", pytrace=False)
                time.sleep(0.5)

    def log_tail(self, lines=30):
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self):
        """Shut down the kernels, then the server; return the processes that had to be killed.

        The process tree is read first: kernels run in sessions of their own, so once the server is
        gone they can no longer be found from it (they would live on as orphans).
        """
        if self.process is None:
            return {}
        tree = descendants(self.process.pid)
        try:
            for kernel in self.api("api/kernels"):
                self.api(f"api/kernels/{kernel['id']}", method="DELETE")
        except OSError:
            pass  # the server is already gone or hung: the signals below handle it
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=WAIT["stop"])
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        return reap(tree, WAIT["stop"])


class Shots:
    """Numbered screenshots of a test's steps, in browser-screenshots/<test name>/ (git-ignored)."""

    def __init__(self, folder):
        self.folder, self.count = folder, 0

    def __call__(self, target, name, **options):
        """Screenshot a page or a locator (an element, clipped to it) as NN-name.png."""
        self.count += 1
        path = self.folder / f"{self.count:02d}-{name}.png"
        target.screenshot(path=str(path), **options)
        return path


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Remember each phase's report on the test, so that fixtures can tell a failed test."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture(scope="session")
def chromium():
    """The Chromium executable; a test without one fails (never skips) saying how to install it."""
    path = os.environ.get("DPCOURSE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path or not os.access(path, os.X_OK):
        pytest.fail(CHROMIUM_HELP, pytrace=False)
    return path


@pytest.fixture
def shots(request):
    folder = SCREENSHOTS / request.node.name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return Shots(folder)


@pytest.fixture
def start_server(tmp_path, shots):
    """start_server(target, make_vars=(), env=None) -> a running Server; all are stopped at the end."""
    servers = []

    def start(target, make_vars=(), env=None):
        server = Server(target, tmp_path / f"jupyter-{len(servers)}", shots.folder / f"{target}-server.log",
                        make_vars, env)
        servers.append(server)
        return server.start()

    yield start
    left = {}
    for server in servers:
        left.update(server.stop())
    assert not left, f"processes of the server outlived it (killed now): {left}"


@pytest.fixture
def page(request, chromium, shots):
    """A page in a fresh headless Chromium; on failure, a last screenshot (failed.png) is kept."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("Playwright is missing from .venv: run `make install` (requirements.txt names it).",
                    pytrace=False)
    before = set(descendants(os.getpid()))
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS,
                                             timeout=WAIT["browser"] * 1000)
        processes = {pid: cmd for pid, cmd in descendants(os.getpid()).items() if pid not in before}
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.set_default_timeout(WAIT["step"] * 1000)
            yield page
            if getattr(request.node, "report_call", None) and request.node.report_call.failed:
                page.screenshot(path=str(shots.folder / "failed.png"))
        finally:
            browser.close()
    left = reap(processes, WAIT["stop"])
    assert not left, f"browser processes outlived the browser (killed now): {left}"
