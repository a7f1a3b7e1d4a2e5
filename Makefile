# The course in one command each. `make help` lists the targets.
# Everything runs from a virtual environment in .venv, created on first use.

PYTHON     ?= python3
VENV       ?= .venv
BIN        := $(CURDIR)/$(VENV)/bin
PY         := $(BIN)/python
# The CPU build of torch by default. For a CUDA build, see README.md ("GPU notes"), e.g.
#   make install TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH_SPEC ?= torch==2.13.0
STAMP      := $(VENV)/.installed
ASSIGNMENTS = $(sort $(notdir $(wildcard solutions/[0-9]*)))
NOTEBOOKS   = $(wildcard solutions/*/*.ipynb)
# nbgrader's tools (alembic, jupyter) must come from the environment; the system's (bwrap, setpriv)
# too, also when make is started with no PATH at all (`env -i make autograde`).
export PATH := $(BIN):$(or $(PATH),/usr/local/bin:/usr/bin:/bin)
# pytest workers (`make test`): one more than the 2 cores of the machines here. Measured with 2: the
# suite waits about a third of its time (browsers, the hub, launches between their ranks): 16 min wall
# for 10 min of CPU. `make autograde` grades JOBS submissions at a time only when JOBS is given
# (`JOBS=4 make autograde`); otherwise autograde.py's own default, 2.
JOBS       ?= 3
LAB_OPTS   ?=
# What `make lab` serves: the course (the browser tests point it at a scratch copy).
LAB_ROOT   ?= $(CURDIR)/course
# nbgrader's course root (autograder/nbgrader_config.py): `make formgrader` serves the same folder.
COURSE_ROOT = $(or $(DPCOURSE_COURSE_ROOT),$(CURDIR))
# Jupyter refuses to run as root unless told (containers and CI run as root).
ROOT_OPT   := $(if $(filter 0,$(shell id -u 2>/dev/null)),--allow-root)

# `make hub`: a class on JupyterHub (hub/). Its users, exchange and state live under HUB_ROOT.
HUB_ROOT       ?= /srv/dpcourse-hub
HUB_INSTRUCTOR ?= instructor
HUB_STUDENTS   ?= student-a student-b
HUB_STAFF      ?= dpcourse-staff
HUB_PORT       ?= 0
# nbgrader's exchange: a shared folder (filesystem), or the ngshare service (ngshare), run as HUB_EXCHANGE_USER
EXCHANGE       ?= filesystem
HUB_EXCHANGE_USER ?= dpcourse-exchange
PROXY_STAMP    := hub/node_modules/.installed
# The machine packages of `make test` (Debian's names): the browser tests' Chromium, the grading
# sandbox's bubblewrap, Node.js for the hub's proxy.
MACHINE_PACKAGES = chromium:chromium bwrap:bubblewrap node:nodejs npm:npm

.PHONY: help install machine-deps browser-deps sandbox-deps proxy lab formgrader as-root hub hub-remove assignments index format grade autograde report test test-under-load lint bench clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 14

# ngshare-exchange (nbgrader's client of ngshare, make hub EXCHANGE=ngshare) without its dependencies: its
# metadata asks for jupyter-core<4.11.2, which JupyterLab 4 cannot run with, while its code uses nothing
# of jupyter-core but jupyter_data_dir (README, "A class on JupyterHub": what was checked).
$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	$(PY) -m pip install --quiet --no-deps ngshare-exchange==0.5.3
	touch $(STAMP)

install: $(STAMP)  ## create .venv with torch (CPU), JupyterLab, nbgrader, JupyterHub (idempotent)

# What `make test` needs from the machine, checked first (a second at most): as root, installed with
# apt; as anyone else, one line saying the command to run.
machine-deps:  ## Chromium, bubblewrap, Node.js: what make test and make hub need (Debian/Ubuntu, as root; idempotent)
	@missing=""; for pair in $(MACHINE_PACKAGES); do command -v $${pair%%:*} >/dev/null 2>&1 || \
	  missing="$$missing $${pair#*:}"; done; \
	if [ -z "$$missing" ]; then exit 0; \
	elif [ "$$(id -u)" = 0 ]; then echo "installing machine packages:$$missing"; \
	  apt-get update -q && apt-get install -y -q $$missing; \
	else echo "make test needs machine packages ($${missing# }): run \`sudo make machine-deps\` once"; exit 1; fi

# Chromium is a machine package (apt, as root), so no learner's target installs it: CI runs this
# (.ci/run) and so does a maintainer, once. Playwright, which drives it, comes with `make install`.
browser-deps:  ## Chromium for the browser tests of `make test` (Debian/Ubuntu, as root; idempotent)
	@if command -v chromium >/dev/null 2>&1; then echo "chromium is installed: $$(command -v chromium)"; \
	elif [ "$$(id -u)" = 0 ]; then apt-get update -q && apt-get install -y -q chromium; \
	else echo "Chromium is a system package: run \`sudo make browser-deps\` (or sudo apt-get install -y chromium)"; \
	  exit 1; fi

# Grading runs learner code in bubblewrap sandboxes (autograder/dpgrader/judge/sandbox.py): a machine
# package, installed by CI (.ci/run) and by an instructor once; a learner may grade with --no-sandbox.
sandbox-deps:  ## bubblewrap, the grading sandbox (Debian/Ubuntu, as root; idempotent)
	@if command -v bwrap >/dev/null 2>&1; then echo "bubblewrap is installed: $$(command -v bwrap)"; \
	elif [ "$$(id -u)" = 0 ]; then apt-get update -q && apt-get install -y -q bubblewrap; \
	else echo "bubblewrap is a system package: run \`sudo make sandbox-deps\` (or sudo apt-get install -y bubblewrap)"; \
	  exit 1; fi

# configurable-http-proxy, JupyterHub's proxy, from npm into hub/node_modules (git-ignored), never
# globally; 5.1.0 is the newest whose dependencies all run on Debian 12's Node.js 18.
$(PROXY_STAMP): hub/package.json hub/package-lock.json
	@command -v npm >/dev/null 2>&1 || { echo "the hub's proxy comes from npm (Node.js): run \`sudo make machine-deps\`"; exit 1; }
	cd hub && npm ci --no-audit --no-fund --loglevel=error
	touch $@

proxy: $(PROXY_STAMP)  ## JupyterHub's proxy (configurable-http-proxy, npm) into hub/node_modules

lab: install  ## JupyterLab on the course (what a learner opens)
	cd autograder && $(BIN)/jupyter lab --ServerApp.root_dir=$(LAB_ROOT) $(ROOT_OPT) $(LAB_OPTS)

formgrader: install  ## JupyterLab on the whole repository, with nbgrader's formgrader (instructors)
	cd autograder && $(BIN)/jupyter lab --ServerApp.root_dir=$(COURSE_ROOT) $(ROOT_OPT) $(LAB_OPTS)

# (first of all: a class's system users need root)
as-root:
	@test "$$(id -u)" = 0 || { echo "make $(MAKECMDGOALS) manages system users: run \`sudo make $(MAKECMDGOALS)\`"; exit 1; }

hub: as-root install $(PROXY_STAMP)  ## a class on JupyterHub (as root): users, nbgrader exchange, formgrader; prints the URL and logins
	$(PY) hub/setup_class.py --root $(HUB_ROOT) --instructor $(HUB_INSTRUCTOR) --students "$(HUB_STUDENTS)" \
	  --staff-group $(HUB_STAFF) --port $(HUB_PORT) --exchange $(EXCHANGE) --exchange-user $(HUB_EXCHANGE_USER)
	cd $(HUB_ROOT)/hub && DPCOURSE_HUB_ROOT=$(HUB_ROOT) exec $(BIN)/jupyterhub -f $(CURDIR)/hub/jupyterhub_config.py

hub-remove: as-root  ## remove the class of make hub: its users, HUB_ROOT; the repository's permissions back (as root)
	$(PY) hub/setup_class.py --root $(HUB_ROOT) --remove

assignments: install  ## regenerate course/ from solutions/ with nbgrader, and the exercise index
	$(PY) autograder/notebooks.py $(NOTEBOOKS)
	cd autograder && for a in $(ASSIGNMENTS); do $(BIN)/nbgrader generate_assignment $$a --force || exit 1; done
	$(PY) autograder/exercises.py

index: install  ## regenerate autograder/exercises.json and the README's exercise table
	$(PY) autograder/exercises.py

format: install  ## normalise solutions/ notebooks (no outputs) and fix lint
	$(PY) autograder/notebooks.py $(NOTEBOOKS)
	$(BIN)/ruff check --fix .

grade: install  ## grade one notebook as nbgrader would: make grade NB=course/00_orientation/00_orientation.ipynb
	@test -n "$(NB)" || { echo "usage: make grade NB=path/to/notebook.ipynb"; exit 2; }
	$(PY) autograder/grade.py $(NB) $(GRADE_OPTS)

# On a class's hub the instructor's judges run in the class's grading service, as root (hub/grading_client.py)
AUTOGRADE   = $(if $(DPCOURSE_GRADING_SOCKET),hub/grading_client.py,autograder/autograde.py)

autograde: install  ## grade every submission in autograder/submitted/ (JOBS at a time), feedback, grades.csv; STUDENT=x: x's only
	$(PY) $(AUTOGRADE) $(if $(filter-out file default undefined,$(origin JOBS)),--jobs $(JOBS)) \
	  $(foreach s,$(STUDENT),--student $(s))

report: install  ## after make autograde: autograder/class_report.html (scores, failures by cause, where each student stopped)
	$(PY) autograder/class_report.py

lint: install  ## ruff
	$(BIN)/ruff check .

test: machine-deps install $(PROXY_STAMP)  ## lint, then every test (launcher, notebooks, grading, lab, browser, hub)
	$(BIN)/ruff check .
	$(PY) -m pytest -n $(JOBS) --dist loadgroup --durations=40

test-under-load: install  ## make test with two busy loops per core beside it: the suite must hold on a loaded machine
	$(PY) tests/under_load.py -- $(MAKE) test

bench: install  ## benchmarks (speed is measured here, never in tests)
	@for b in tests/bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:  ## remove the environment (and the hub's proxy) and nbgrader's working files
	rm -rf $(VENV) hub/node_modules autograder/submitted autograder/autograded autograder/feedback \
	  autograder/gradebook.db autograder/grades.csv autograder/class_record.json autograder/class_report.html \
	  .pytest_cache .ruff_cache
	find . -name __pycache__ -prune -exec rm -rf {} +
