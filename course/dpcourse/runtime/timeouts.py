"""Every timeout of the course in one table: how long a wait may last before it is an error.

Why one table: a deadlock must end in seconds with a message naming the rank that waited,
and every bound must sit below the one that encloses it (a blocked recv < a launch < a
notebook cell), or a learner gets nbgrader's bare cell timeout instead of a diagnosis.
Environment variables override the launch defaults (DPCOURSE_DEADLINE, DPCOURSE_GROUP_TIMEOUT).

    from dpcourse.runtime.timeouts import TIMEOUTS
    launch(fn, 4, group_timeout=TIMEOUTS["test_group"])
"""

TIMEOUTS = {
    # a whole launch, wall clock: stops a rank spinning in Python (launch's default)
    "launch": 60.0,
    # a recv or collective waiting for its peers (launch's default)
    "group": 10.0,
    # test cells and hidden checks: a blocked collective is a bug well before 10 s
    "test_group": 5.0,
    # communication exercises (send/recv): a blocked send or recv counts as a deadlock
    "p2p_deadlock": 3.0,
    # one notebook cell under nbgrader (above every launch deadline)
    "cell": 300.0,
}
