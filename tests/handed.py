"""What every launch hands each rank, recorded: a stand-in for the grader's runner that runs the ranks here.

    with HandedRecorder() as handed:
        check_ring_all_reduce(ring_all_reduce)         # every launch inside is recorded, then run
    handed.launches[0].per_rank[2]                      # (fn, args, kwargs) as rank 2 was sent them

While graded, the judge sends each rank `for_rank((fn, args, kwargs), rank)`: its own per_rank values and
what every rank gets alike (dpgrader.judge.ranks.RankPool.launch). This records exactly that, names the
module that called `launch`, and then launches here as a notebook would. Used by
tests/library/test_comm_cases.py.
"""

import inspect
from dataclasses import dataclass

from dpcourse.runtime import launcher
from dpcourse.runtime.inside_rank import for_rank


@dataclass
class Launch:
    fn: object
    world_size: int
    per_rank: list  # per rank, (fn, args, kwargs) as it would be sent to that rank
    caller: str  # the module that called dpcourse's launch (outside dpcourse.runtime and dpcourse.comm.cases)


class HandedRecorder:
    last_traffic = last_flow = last_memory = None

    def __init__(self):
        self.launches = []
        self.deferred = []

    def __enter__(self):
        launcher.use_runner(self)
        return self

    def __exit__(self, *exc):
        launcher.use_runner(None)
        return False

    def launch(self, fn, world_size, args, kwargs, *, deadline, group_timeout):
        per_rank = [for_rank((fn, args, kwargs), rank, world_size) for rank in range(world_size)]
        self.launches.append(Launch(fn, world_size, per_rank, _caller()))
        launcher.use_runner(None)
        try:
            return launcher.launch(fn, world_size, *args, deadline=deadline, group_timeout=group_timeout,
                                   **kwargs)
        finally:
            launcher.use_runner(self)


def _caller():
    for frame in inspect.stack()[2:]:
        name = frame.frame.f_globals.get("__name__", "")
        if name not in ("dpcourse.runtime.launcher", "dpcourse.comm.cases", __name__):
            return name
    return "?"
