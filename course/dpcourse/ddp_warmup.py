"""Pay DistributedDataParallel's one-time import cost once, in the parent, before ranks fork.

The first `DistributedDataParallel(...)` in a process imports `torch._dynamo`
(it checks whether it is being compiled): about 1.7 s of imports. A launch forks
fresh ranks every time, so without this each rank of each launch pays it again,
all at once on a few cores: a DDP launch of 2 ranks took 3.5 s instead of 0.1 s
on a 2-core machine, 4 ranks 6.6 s. Importing it once in the notebook's kernel
(or the test process) lets every forked rank inherit it for free.
"""

import importlib


def warm_up():
    """Import what DDP's constructor imports lazily; call it before launching DDP ranks."""
    importlib.import_module("torch._dynamo")
