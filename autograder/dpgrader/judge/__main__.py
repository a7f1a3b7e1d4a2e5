"""`python -m dpgrader.judge ...`: the judge's command line (dpgrader.judge.cells), with its sandboxes
started before the judge imports torch, so that the two costs overlap (see zygotes.py)."""

import sys

from dpgrader.judge import zygotes

zygotes.start_early(sandboxed="--no-sandbox" not in sys.argv[1:])

from dpgrader.judge.cells import main  # noqa: E402 - after the sandboxes started

sys.exit(main())
