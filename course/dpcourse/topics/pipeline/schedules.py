"""Pipeline schedules as data: check one, simulate it with ideal timings, count its bubble and memory.

A schedule is, for each stage, the ordered list of what it computes: ("F", i) is the
forward of micro-batch i, ("B", i) its backward. GPipe is [F0 .. F(m-1), B0 .. B(m-1)] on
every stage; 1F1B (notebook 07's exercise) interleaves them.

    schedules = [gpipe_schedule(4, 8, s) for s in range(4)]
    check_schedule(schedules, 8)                     # a clear ValueError if it cannot run
    timelines = simulate(schedules, forward=1, backward=2)
    idle_fraction(timelines), bubble_fraction(4, 8)  # both 3/11 = 0.273
    [in_flight(s) for s in schedules]                # micro-batches held at the peak: [8, 8, 8, 8]

Why simulate: the bubble formula (p - 1)/(m + p - 1) assumes every forward takes the same
time t_f, every backward t_b, and messages take no time. Simulating a schedule under those
assumptions gives the formula's picture of it, which a measured timeline is compared
with; simulating it again with the message delay measured on this machine shows how much
of the difference the messages explain. The simulation runs each stage's actions in
order, each as soon as its inputs exist: F(s, i) after F(s - 1, i), B(s, i) after
B(s + 1, i) (on the last stage, after F(s, i)), plus the delay of the message between.

Used by notebook 07 and its benchmark; notebook 09 reuses the pictures.
"""


def gpipe_schedule(n_stages, n_micro, stage):
    """GPipe on one stage: every forward, then every backward, both in micro-batch order."""
    _check_sizes(n_stages, n_micro, stage)
    return [("F", i) for i in range(n_micro)] + [("B", i) for i in range(n_micro)]


def bubble_fraction(n_stages, n_micro):
    """(p - 1)/(m + p - 1): the share of a step each stage idles in GPipe or 1F1B, with ideal timings.

    Each stage works m (t_f + t_b) of a step that lasts (m + p - 1)(t_f + t_b): the last
    micro-batch's forward reaches stage s after s forward times, and the first backward
    comes back after p - 1 - s more. Megatron-LM (Narayanan et al. 2021) writes the same bubble
    relative to the ideal time instead of the whole step: (p - 1)/m.
    """
    return (n_stages - 1) / (n_micro + n_stages - 1)


def in_flight(schedule):
    """The most micro-batches a stage holds at once: forwards done whose backward is still to come."""
    held = peak = 0
    for kind, _ in schedule:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


def check_schedule(schedules, n_micro):
    """Raise a ValueError saying what is wrong unless every stage runs each F i and B i exactly once,
    forwards and backwards each in micro-batch order, B i after F i, and the stages never wait
    for each other in a circle."""
    for s, schedule in enumerate(schedules):
        actions = [tuple(a) for a in schedule]
        bad = [a for a in actions if len(a) != 2 or a[0] not in ("F", "B") or not isinstance(a[1], int)]
        if bad:
            raise ValueError(f"stage {s}: {bad[0]!r} is not ('F', i) or ('B', i)")
        for kind in ("F", "B"):
            order = [i for k, i in actions if k == kind]
            if order != list(range(n_micro)):
                raise ValueError(f"stage {s}: its {kind} actions are for micro-batches {order}, expected "
                                 f"{list(range(n_micro))} in that order")
        for i in range(n_micro):
            if actions.index(("B", i)) < actions.index(("F", i)):
                raise ValueError(f"stage {s}: B{i} comes before F{i}")
    simulate(schedules)  # raises on a circular wait
    return True


def simulate(schedules, forward=1.0, backward=2.0, delay=0.0):
    """Per stage, [(kind, i, start, end), ...] when each action runs as early as its inputs allow.

    delay: the time a message takes from one stage to the next (0 in the bubble formula).
    """
    p = len(schedules)
    done = {}  # (kind, stage, i) -> end time
    free = [0.0] * p
    position = [0] * p
    timelines = [[] for _ in range(p)]
    remaining = sum(len(s) for s in schedules)
    while remaining:
        progressed = False
        for s in range(p):
            if position[s] == len(schedules[s]):
                continue
            kind, i = schedules[s][position[s]]
            if kind == "F":
                ready = 0.0 if s == 0 else _after(done.get(("F", s - 1, i)), delay)
            else:
                ready = done.get(("F", s, i)) if s == p - 1 else _after(done.get(("B", s + 1, i)), delay)
            if ready is None:
                continue
            start = max(free[s], ready)
            end = start + (forward if kind == "F" else backward)
            done[(kind, s, i)] = free[s] = end
            timelines[s].append((kind, i, start, end))
            position[s] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            waiting = ", ".join(f"stage {s} at {schedules[s][position[s]][0]}{schedules[s][position[s]][1]}"
                                for s in range(p) if position[s] < len(schedules[s]))
            raise ValueError(f"the stages wait for each other in a circle: {waiting}")
    return timelines


def _after(time, delay):
    return None if time is None else time + delay


def idle_fraction(timelines):
    """The share of the step (first start to last end, over all stages) the stages spent idle."""
    events = [e for timeline in timelines for e in timeline]
    if not events:
        return 0.0
    start = min(e[2] for e in events)
    span = max(e[3] for e in events) - start
    busy = sum(e[3] - e[2] for e in events)
    return 1 - busy / (len(timelines) * span) if span > 0 else 0.0


def _check_sizes(n_stages, n_micro, stage):
    if n_stages < 1 or n_micro < 1 or not 0 <= stage < n_stages:
        raise ValueError(f"need n_stages >= 1, n_micro >= 1 and 0 <= stage < n_stages, got "
                         f"{n_stages}, {n_micro}, {stage}")


def parse_order(text):
    """'F0 F1 B0' -> [("F", 0), ("F", 1), ("B", 0)]: schedules written the way timelines label them."""
    return [(item[0], int(item[1:])) for item in text.split()]


def format_order(order):
    """[("F", 0), ("B", 0)] -> 'F0 B0'."""
    return " ".join(f"{kind}{i}" for kind, i in order)
