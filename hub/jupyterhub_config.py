"""JupyterHub for a class of this course: `make hub` (README, "A class on JupyterHub").

`make hub` runs hub/setup_class.py (users, exchange, the instructor's course root; ROOT/hub/class.json),
then `jupyterhub -f hub/jupyterhub_config.py` as root with DPCOURSE_HUB_ROOT=ROOT.

What a real deployment changes, here:
- the authenticator: PAM (JupyterHub's default) with the system users setup_class.py made and the
  passwords it printed. A school puts its single sign-on in place of it (`authenticator_class`,
  e.g. oauthenticator's GenericOAuthenticator) and keeps `allowed_users` or uses its groups;
- the spawner: LocalProcessSpawner, JupyterHub's default (hub/spawner.py): each user's server is a
  process of that system user, kept apart from the others by file permissions (homes 0700, the
  exchange's rules, the repository closed to all but the staff), in a cgroup of its own with the CPU,
  memory and process limits below (where systemd runs, systemdspawner's SystemdSpawner gives the same);
  for a class that outgrows one machine, KubeSpawner (Zero to JupyterHub: hub/k8s/);
- the exchange: nbgrader's shared folder (EXCHANGE=filesystem), or ngshare, a JupyterHub service that
  needs no shared filesystem (EXCHANGE=ngshare; what a class on Kubernetes uses);
- grading: the class's grading service (hub/grading_service.py), root's, through which the instructor's
  `make autograde` and Autograde button judge each submission in a pid namespace, cgroup and user ids of
  its own, exactly as `make autograde` run by root;
- the address: 127.0.0.1 and *.localhost here; a hub for a class listens on a public name behind
  HTTPS, with a wildcard DNS entry for the users' subdomains (`bind_url`, `subdomain_host`,
  `ssl_cert`/`ssl_key` or a reverse proxy in front).
"""

import json
import os
import socket
import sys
from pathlib import Path

HUB = Path(__file__).resolve().parent
sys.path.insert(0, str(HUB))
from spawner import ClassSpawner, environment  # noqa: E402

ROOT = Path(os.environ["DPCOURSE_HUB_ROOT"])
CLASS = json.loads((ROOT / "hub" / "class.json").read_text())
STATE = ROOT / "hub"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


c = get_config()  # noqa: F821 - provided by traitlets when it loads this file

# Where: the public port chosen by setup_class.py (a free one unless HUB_PORT was given); the hub's own
# API and the proxy's API on free ports too; the hub's database and secret in ROOT/hub (root only).
c.JupyterHub.bind_url = f"http://127.0.0.1:{CLASS['port']}"
# Each user's server on a host of its own (http://USER.localhost:PORT; browsers resolve *.localhost to
# this machine), so that no user's page shares an origin with another's. Only then may a server let
# its own pages frame it, which the formgrader panel needs (hub/config/*/jupyter_server_config.json;
# JupyterHub's default forbids frames, nbgrader's documentation explains why).
c.JupyterHub.subdomain_host = f"http://localhost:{CLASS['port']}"
c.JupyterHub.hub_bind_url = f"http://127.0.0.1:{free_port()}"
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{free_port()}"
c.ConfigurableHTTPProxy.command = [str(HUB / "node_modules" / ".bin" / "configurable-http-proxy")]
c.JupyterHub.db_url = f"sqlite:///{STATE / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(STATE / "jupyterhub_cookie_secret")
c.JupyterHub.pid_file = str(STATE / "jupyterhub.pid")
# When the hub stops, so do the proxy and every user's server (with their kernels and terminals).
c.JupyterHub.cleanup_servers = True
c.JupyterHub.cleanup_proxy = True

# Who: the class's users, logging in with their system passwords (PAM).
c.JupyterHub.authenticator_class = "pam"
c.Authenticator.allowed_users = {CLASS["instructor"], *CLASS["students"]}
c.PAMAuthenticator.open_sessions = False  # no login session (utmp, pam_systemd) per server: not a shell

# How: each user's JupyterLab from the course's Python environment, as that user, in their home
# (LocalProcessSpawner, which spawner.py makes able to run a Python installed in a private folder).
c.JupyterHub.spawner_class = ClassSpawner
c.Spawner.cmd = [str(Path(sys.prefix) / "bin" / "jupyterhub-singleuser")]
c.Spawner.default_url = "/lab"
c.Spawner.start_timeout = 120
c.Spawner.http_timeout = 120  # a busy shared machine can take a minute and more to start a server
# A server stops within seconds of SIGINT; the default 30 s of patience before SIGTERM only slows `make
# hub`'s stop when one does not.
c.LocalProcessSpawner.interrupt_timeout = 10


def role_environment(spawner):
    """Each role's settings (spawner.environment): the exchange, the course root, the configuration."""
    spawner.environment.update(environment(CLASS, spawner.user.name))


c.Spawner.pre_spawn_hook = role_environment

# Limits per user on a shared machine: each user's server and everything it starts (kernels, terminals,
# a notebook's 2-8 ranks) share one cgroup (hub/user_cgroup.py). Sized from the course's heaviest
# notebook, measured (README, "A class on Kubernetes": peak memory and CPU of one learner running it):
# a student's own runs fit; a memory bomb in their kernel is killed there, and nobody else notices.
# DPCOURSE_HUB_MEM_LIMIT / _CPU_LIMIT / _PIDS_LIMIT override them (the hub's test uses a small one).
memory = os.environ.get("DPCOURSE_HUB_MEM_LIMIT", "3G")
c.Spawner.mem_limit = int(memory) if memory.isdigit() else memory  # bytes, or with K, M, G, T
c.Spawner.cpu_limit = float(os.environ.get("DPCOURSE_HUB_CPU_LIMIT", "2"))
c.ClassSpawner.pids_limit = int(os.environ.get("DPCOURSE_HUB_PIDS_LIMIT", "1024"))

# The class's grading service, as root (hub/grading_service.py); the grader's limits per submission come
# from the course's sandbox (autograder/dpgrader/judge/sandbox.py: LIMITS), overridable as for `make
# autograde` by these variables of the hub's environment.
GRADING_SETTINGS = ("DPCOURSE_SANDBOX_MEMORY", "DPCOURSE_SANDBOX_PIDS", "DPCOURSE_DEADLINE",
                    "DPCOURSE_GROUP_TIMEOUT", "DPCOURSE_JUDGE_MEMORY", "DPCOURSE_SANDBOX_SCRATCH")
c.JupyterHub.services = [{
    "name": "dpcourse-grading",
    "command": [sys.executable, str(HUB / "grading_service.py"), "--root", str(ROOT)],
    "environment": {key: os.environ[key] for key in GRADING_SETTINGS if key in os.environ},
}]

# The exchange as a service: ngshare, as the exchange's own user, reached by the users' servers on
# loopback (ngshare_url); its requests carry each user's JupyterHub token (hub/ngshare_service.py).
if CLASS.get("exchange_kind") == "ngshare":
    c.JupyterHub.services.append({
        "name": "ngshare",
        "url": f"http://127.0.0.1:{CLASS['ngshare_port']}",
        "command": [sys.executable, str(HUB / "ngshare_service.py"), "--root", str(ROOT)],
    })
