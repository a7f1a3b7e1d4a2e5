"""`make lab` serves the course with nbgrader's extensions, headless on a free loopback port."""

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request

from conftest import REPO


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url):
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.read().decode()


def test_make_lab_serves_the_course_with_nbgrader_enabled():
    port, token = free_port(), "dpcourse-test"
    opts = (f"--no-browser --ip=127.0.0.1 --port={port} --ServerApp.port_retries=0 "
            f"--IdentityProvider.token={token}")
    server = subprocess.Popen(["make", "-s", "lab", f"LAB_OPTS={opts}"], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                status, _ = get(f"{base}/api/status?token={token}")
                break
            except OSError:
                assert server.poll() is None, server.stdout.read()
                assert time.monotonic() < deadline, "JupyterLab did not start within 90 s"
                time.sleep(0.5)
        status, body = get(f"{base}/api/contents/00_orientation?token={token}")
        names = [item["name"] for item in json.loads(body)["content"]]
        assert "00_orientation.ipynb" in names
        status, body = get(f"{base}/api/contents?token={token}")
        assert "solutions" not in body  # learners see course/, not the solutions
        status, page = get(f"{base}/lab?token={token}")
        assert "@jupyter/nbgrader" in page  # the lab extension (assignment list, validate button)
        status, _ = get(f"{base}/formgrader?token={token}")
        assert status == 200  # the formgrader server extension answers
        status, body = get(f"{base}/nbgrader_version?version=0&token={token}")
        assert status == 200  # the assignment_list server extension answers
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
