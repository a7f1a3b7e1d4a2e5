"""`python -m dpgrader.judge ...`: the judge's command line (dpgrader.judge.cells), with its sandboxes
started before the judge imports torch, so that the two costs overlap (see zygotes.py)."""

import importlib
import sys
import threading

from dpgrader.judge import zygotes

zygotes.start_early(sandboxed="--no-sandbox" not in sys.argv[1:])

from dpgrader.judge.cells import main  # noqa: E402 - after the sandboxes started

# While the sandboxes warm up the judge has time to spare: torch's compiler package, which the first
# optimizer a setup cell or a check builds imports (1.7 s here; notebooks 02, 05, 06, 10, 11), loads
# in the meantime.
threading.Thread(target=importlib.import_module, args=("torch._dynamo",)).start()

sys.exit(main())
