"""hub/setup_class.py never takes over a user it did not make, and `--remove` undoes what it made."""

import os
import pwd
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from .conftest import REPO


def test_a_class_never_takes_over_an_existing_user():
    if os.geteuid() != 0:
        pytest.skip("setup_class.py manages system users: run as root (make test as root, as CI does)")
    root = Path(tempfile.mkdtemp(prefix="dpcourse-hub-setup-test-"))
    os.chmod(root, 0o755)
    before = pwd.getpwnam("nobody")
    setup = [sys.executable, str(REPO / "hub" / "setup_class.py"), "--root", str(root)]
    try:
        made = subprocess.run([*setup, "--instructor", "dpchub-x", "--students", "nobody", "--staff-group",
                               "dpchub-x-staff"], capture_output=True, text=True, timeout=120)
        assert made.returncode == 1 and "a user named nobody already exists" in made.stderr, made.stderr
        assert pwd.getpwnam("nobody") == before, "setup_class.py changed the user nobody"
        assert pwd.getpwnam("dpchub-x").pw_dir == str(root / "home" / "dpchub-x")
    finally:
        removed = subprocess.run([*setup, "--remove"], capture_output=True, text=True, timeout=120)
    assert removed.returncode == 0, removed.stderr
    with pytest.raises(KeyError):
        pwd.getpwnam("dpchub-x")
    assert pwd.getpwnam("nobody") == before and not root.exists()
