"""Run an exercise's cases on ranks and get back what each rank did: the one case runner of the course.

    cases = [Case(parts=[x0, x1, x2, x3], shared={"k": 2}, label="4 ranks")]
    for case, runs in zip(cases, run_cases(per_case, learner_fn, 4, cases, exercise="ring_shift")):
        runs[2].values["result"], runs[2].result       # what rank 2's per-case function reported
        runs[2].ops, runs[2].phases["backward"]         # its calls (the router's, while graded)

Every chapter's runner is a per-case function (what one rank does with the learner's code in one
case, returning plain values) and its checks; this module does the rest, once, for all of them
(notebooks 00, 03, 04, 07-12). It lives in `comm`, under the topics and beside the recorder,
the router's log and the provenance replay it stands on (and over `runtime`, whose launcher it
uses): nothing about one chapter is here.

What it guarantees, made here once:

1. **A rank is sent its own part only.** A `Case` holds `parts` (one per world rank: that rank's
   inputs) and `shared` (what every rank is given alike: sizes, the arguments of a model every rank
   builds, a learning rate). `run_cases` launches with `per_rank([... case.for_rank(r) ...])` and
   nothing else, so while graded rank r is sent parts[r] and never its peers' (a function that looks
   for `case` in its caller's frames finds a `RankCase` with its own part). Whatever a rank learns of
   its peers' data, it learns from messages. A runner keeps nothing of its peers' inputs in `shared`:
   tests/library/test_comm_cases.py records what every launch of a graded run hands each rank.
2. **A failure is reported, never raced.** The rank-side loop (`rank_loop`) catches what the
   learner's code raised and reports it: a collective in a point-to-point exercise ("forbidden"), a
   peer that does not exist ("bad_peer"), a wait that timed out ("stuck", with the call it was
   blocked in), anything else ("raised", with its traceback). A rank whose code raised ends the
   launch (launcher.STOP_LAUNCH: the others would only wait for it); ranks that fail alike report
   within the launcher's grace. The caller then blames the LOWEST failing rank, so a grade names
   the same rank whatever the timing: a learner's exception as `launch` words one ("rank 0 of 4
   raised ValueError: ..."), other problems when the case is reached (earlier cases are checked first).
3. **The router's log is the truth.** While graded every call goes through the grader's router,
   which logs it outside the ranks. Each rank's own recorder only says where its calls fall (which
   case, which phase: `RankContext.phase`); its calls, in order, must be the router's (a failed case
   may have recorded one call more, which the router refused before logging it, a message to itself
   say), and then every record is replaced by the router's (bytes, peers, groups as the router saw
   them; a refused trailing call stays as the rank recorded it). Why this policy and not "compare
   only": the records checks count must be ones the learner's code cannot touch; why not "replace
   only": a call hidden from the recorder would shift every later call into the wrong case or phase,
   so a disagreement is an error of its own. Barriers carry no
   data and are left out on both sides (the launcher and some runners use them).
4. **How values were reached is replayed** where they could be computed without the messages (test
   inputs can be guessed): a case's `replay` (dpcourse.comm.provenance: `Sums`, `Copies`) is run,
   while graded, on the router's record of every message and collective of that case, once the test
   cell's own checks passed (launcher.check_after_cell).

One record for every chapter: `RankRun` (what one rank did in one case): its group, its calls and
their phases, the values its per-case function reported (read as attributes: `run.output`), and its
failure. One way to make groups (`make_groups`, inside the rank) and one `members_of` (the caller).
"""

import re
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dpcourse.comm.recorder import CommOp, CommRecorder, ForbiddenCollective, PeerError
from dpcourse.runtime.failures import LaunchError, reported_failure
from dpcourse.runtime.inside_rank import to_cpu
from dpcourse.runtime.launcher import (
    STOP_LAUNCH,
    check_after_cell,
    current_options,
    launch,
    launch_options,
    observed_memory,
    observed_messages,
    observed_traffic,
    per_rank,
)
from dpcourse.runtime.timeouts import TIMEOUTS

# A wait that ended without its partner: a timeout, or a peer that went away.
WAITED = re.compile(r"timed out|timeout|closed by peer|connection reset|broken pipe|connection closed"
                    r"|socket closed|connection refused", re.I)
UNPHASED = "call"  # the phase of calls made before a per-case function names one
SETUP = "setup"  # a phase of the scaffolding's own calls (DDP's start-up): launch_run leaves them out


# --------------------------------------------------------------------------- cases (caller side)

@dataclass
class Case:
    """One case of an exercise. What each rank is sent is its own part, by construction.

    parts: parts[r] is what rank r alone is sent (its inputs); None makes rank r sit the case out.
    shared: what every rank is sent alike; never another rank's inputs.
    groups: lists of world ranks (each rank runs on the group it belongs to); None: the whole world.
    label: a few words naming the case in messages.
    replay: how the case's values must be made of its inputs (dpcourse.comm.provenance), checked while
        graded after the cell's own checks; None: not replayed. Stays with the caller, as does `about`
        (the caller's own description of the case, which `describe` and `advice` are given).
    """

    parts: list
    shared: object = None
    groups: list | None = None
    label: str | None = None
    replay: object = None
    about: object = None  # the caller's own description of the case (what its checks read); never sent

    @property
    def world_size(self):
        return len(self.parts)

    def for_rank(self, rank, index=0):
        """What rank `rank` is sent of this case: its part and the shared values, nothing of its peers'."""
        return RankCase(index, rank, self.world_size, self.parts[rank], self.shared, self.groups, self.label)


@dataclass
class RankCase:
    """A case as one rank receives it."""

    index: int
    rank: int
    world_size: int
    part: object
    shared: object
    groups: list | None
    label: str | None


def members_of(groups, rank, world_size):
    """The world ranks of the group `rank` belongs to (in group-rank order), or None if in none."""
    if groups is None:
        return tuple(range(world_size))
    return next((tuple(members) for members in groups if rank in members), None)


# --------------------------------------------------------------------------- records (caller side)

@dataclass
class RankRun:
    """What one rank did in one case (built by the caller from the rank's plain report).

    The values the per-case function reported read as attributes (`run.output` is
    `run.values["output"]`), and so do the phases (`run.backward` is `run.phases["backward"]`).
    """

    rank: int  # world rank
    group: tuple | None  # world ranks of its group, in group-rank order; None: it sat the case out
    values: dict = field(default_factory=dict)  # what its per-case function reported (plain values)
    ops: list = field(default_factory=list)  # CommOp records of the whole case (the router's while graded)
    phases: dict = field(default_factory=dict)  # phase name -> its CommOp records, in order
    failure: tuple | None = None  # (kind, text): "raised", "stuck", "forbidden", "bad_peer", "ended"; None
    observed: dict | None = None  # what the per-case function watched (reported even when it failed)
    memory: dict | None = None  # while graded with memory measured: what the rank's zygote measured

    def __getattr__(self, name):
        if name.startswith("__") or name in ("values", "phases"):
            raise AttributeError(name)
        if name in self.values:
            return self.values[name]
        if name in self.phases:
            return self.phases[name]
        raise AttributeError(f"{type(self).__name__} of rank {self.rank} has no {name!r} (reported: "
                             f"{', '.join(sorted(self.values)) or 'nothing'})")

    @property
    def group_rank(self):
        return None if self.group is None else self.group.index(self.rank)

    @property
    def group_size(self):
        return len(self.group or ())

    @property
    def group_members(self):
        return None if self.group is None else list(self.group)

    def _failure(self, kind):
        return self.failure[1] if self.failure is not None and self.failure[0] == kind else None

    @property
    def stuck(self):
        return self._failure("stuck")

    @property
    def forbidden(self):
        return self._failure("forbidden")

    @property
    def bad_peer(self):
        return self._failure("bad_peer")

    @property
    def sends(self):
        return [o for o in self.ops if o.op == "send"]

    @property
    def sent_bytes(self):
        return sum(o.nbytes for o in self.sends)


def members(runs):
    """The runs of the ranks that took part (a case on a sub-group leaves the others out)."""
    return [r for r in runs if r is not None and r.group is not None]


# --------------------------------------------------------------------------- the rank side

_GROUPS = {}  # inside a rank: groups already made, by layout (cases often share one)


def make_groups(groups):
    """Inside a rank: make every group of a layout (every rank makes every group, in the same order:
    dist.new_group is collective), once per layout; return (this rank's group, its members), (None, the
    world) without groups, (None, None) for a rank in none of them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if groups is None:
        return None, tuple(range(world))
    key = (world, tuple(tuple(members) for members in groups))
    if key not in _GROUPS:
        _GROUPS[key] = [(dist.new_group(list(members)), tuple(members)) for members in groups]
    return next(((g, m) for g, m in _GROUPS[key] if rank in m), (None, None))


class RankContext:
    """What a per-case function is given besides the learner's code and its part.

    rank, world_size, group (None: the world), members, group_rank, group_size, shared, label,
    exercise; `phase(name)` starts a phase of the case's calls (the calls before the first are in
    "call"). A per-case function may also set, before calling the learner's code:
      observe: () -> dict of plain values, reported even when the case failed;
      where: () -> a few words on where the rank was in its work ("stage 1, after the forward of
        micro-batch 2"), for the message of a failure; hint: (exception) -> a sentence added to it;
      not_written: what a NotImplementedError from the learner's code reports (default: its own text);
      ended: a few words, when the case ended in an error the per-case function reported in its own
        values (a step that raised, for its checks to explain): the rank's cases stop there, as after
        any failure (its peers would not match the next case's calls).
    """

    def __init__(self, case, group, group_members, exercise, p2p_only):
        self.case, self.rank, self.world_size = case, case.rank, case.world_size
        self.group, self.members = group, group_members
        self.group_rank, self.group_size = group_members.index(case.rank), len(group_members)
        self.shared, self.exercise = case.shared, exercise
        self.label = case.label or exercise
        self.recorder = CommRecorder(p2p_only=p2p_only, exercise=exercise)
        self.phase_starts = []
        self.observe = self.where = self.hint = self.not_written = self.ended = None

    @property
    def group_kwargs(self):
        """{"group": this rank's group} when the case names groups, else {} (the default group)."""
        return {} if self.case.groups is None else {"group": self.group}

    def phase(self, name):
        """The calls from here on belong to phase `name` (until the next)."""
        self.phase_starts.append((name, len(self.recorder.ops)))

    def call(self, fn, *args, **kwargs):
        """Call the learner's code; an exception of its own names the exercise, the case and the rank
        (and, for an index out of range on a rank whose world rank is past its group's size, the likely
        cause). Communication outcomes (a refused collective, a bad peer, a wait that timed out) pass
        through as they are, for the loop to report."""
        try:
            return fn(*args, **kwargs)
        except (ForbiddenCollective, PeerError):
            raise
        except NotImplementedError as exc:  # the same on every rank (the launcher says "not written yet")
            raise NotImplementedError(f"{self.exercise} ({self.label})") from exc
        except Exception as exc:
            if isinstance(exc, RuntimeError) and WAITED.search(str(exc)):
                raise
            if isinstance(exc, IndexError) and self.case.groups is not None and self.rank >= self.group_size:
                n = self.group_size
                raise RuntimeError(
                    f"{self.exercise} ({self.label}) raised on the ranks of group {list(self.members)} whose "
                    f"world rank is {n} or more: {type(exc).__name__}: {exc} -- a group of {n} has slices 0 "
                    f"to {n - 1}: was the index the world rank (dist.get_rank()) instead of the rank in the "
                    f"group (dist.get_rank(group))?") from exc
            raise RuntimeError(f"{self.exercise} ({self.label}) raised on rank {self.rank}: "
                               f"{type(exc).__name__}: {exc}") from exc


def rank_loop(per_case, learner, cases, exercise, p2p_only):
    """Runs on every rank: per_case(learner, part, ctx) for each of its cases, in order.

    Reports plain values only: per case, what the per-case function returned, its calls as the
    rank's recorder saw them (rows, with where each phase starts), what it watched, and its failure.
    The first failure ends the rank's cases (its peers would not match the next case's calls); one
    the learner's code raised also ends the launch (launcher.STOP_LAUNCH).
    """
    reports = []
    for case in cases:
        group, group_members = make_groups(case.groups)
        if group_members is None or case.part is None:
            reports.append({"sat_out": True})
            continue
        ctx = RankContext(case, group, group_members, exercise, p2p_only)
        report = {}
        reports.append(report)
        try:
            with ctx.recorder:
                report["values"] = per_case(learner, case.part, ctx)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, for the caller to blame
            report["failure"] = _failure_of(exc, ctx)
        if ctx.ended is not None and not report.get("failure"):
            report["failure"] = ["ended", str(ctx.ended)]
        if ctx.observe is not None:
            report["observed"] = to_cpu(ctx.observe())
        report["values"] = to_cpu(report.get("values") or {})
        report["ops"] = [o.row() for o in ctx.recorder.ops]
        report["phases"] = [list(p) for p in ctx.phase_starts]
        if report.get("failure"):
            if report["failure"][0] == "raised":
                return {STOP_LAUNCH: True, "reports": reports}
            break
    return {"reports": reports}


def _failure_of(exc, ctx):
    """(kind, ...) of what a case raised, as the caller words it (see the module docstring)."""
    where = ctx.where() if ctx.where is not None else None
    hint = ctx.hint(exc) if ctx.hint is not None else ""
    if isinstance(exc, ForbiddenCollective):
        return ["forbidden", str(exc)]
    if isinstance(exc, PeerError):
        return ["bad_peer", f"rank {ctx.rank}{', ' + where if where else ''}: {exc}{hint}"]
    if isinstance(exc, RuntimeError) and "Pair is not connected" in str(exc):
        return _raised(RuntimeError(
            f"{ctx.exercise}: rank {ctx.rank} sent to or received from itself (gloo: \"Pair is not "
            f"connected\"): a rank has no connection to itself; on a single rank there is nobody to talk to"),
            exc)
    if isinstance(exc, RuntimeError) and WAITED.search(str(exc)):
        return ["stuck", _blocked_in(exc, ctx.recorder.ops)]
    if isinstance(exc, NotImplementedError):
        return _raised(NotImplementedError(ctx.not_written if ctx.not_written is not None else str(exc)), exc)
    if where is not None:
        return _raised(RuntimeError(f"{ctx.exercise} on rank {ctx.rank}, {where}: {type(exc).__name__}: "
                                    f"{exc}{hint}"), exc)
    return _raised(exc, exc)


def _raised(shown, original):
    """["raised", type name, message, traceback]: what `launch` would have said of the exception."""
    text = "".join(traceback.format_exception(original))
    if shown is not original:
        text += f"\n{type(shown).__name__}: {shown}\n"
    return ["raised", type(shown).__name__, str(shown), text]


def _blocked_in(exc, ops):
    """Which call a rank was blocked in, from its traceback and the recorder's last calls."""
    frames = traceback.extract_tb(exc.__traceback__)
    c10d = [f for f in frames
            if f.filename.replace("\\", "/").endswith("torch/distributed/distributed_c10d.py")]
    call = c10d[0].name if c10d else "wait"
    user = [f for f in frames if "site-packages" not in f.filename and "/dpcourse/" not in f.filename]
    where = f" (`{user[-1].line.strip()}`)" if user and user[-1].line else ""
    last = ops[-1] if ops else None
    if call in ("send", "recv", "isend", "irecv") and last is not None and last.op in ("send", "recv"):
        direction = "to" if last.op == "send" else "from"
        return f"in {call} {direction} rank {last.world_peer}{where}"
    recent = ", ".join(f"{o.op} {'to' if o.op == 'send' else 'from'} rank {o.world_peer}" for o in ops[-2:])
    return f"in {call}(){where}" + (f", after {recent}" if recent else "")


# --------------------------------------------------------------------------- the caller side

class CaseRuns(list):
    """runs[case][rank] (RankRun). A case's problems (a deadlock, a collective where only messages
    may go, a bad peer) raise when that case is reached, by index or in a loop, so a caller that
    checks each case as it comes reports the first thing that went wrong."""

    def __init__(self, runs, problems, replays):
        super().__init__(runs)
        self._problems, self._replays = problems, replays

    @property
    def unchecked(self):
        """runs[case][rank] without raising any case's problem (to add what the caller computes)."""
        return list(super().__iter__())

    def _reached(self, index):
        index = range(len(self))[index]
        if self._problems[index] is not None:
            raise self._problems[index]
        replay, self._replays[index] = self._replays[index], None
        if replay is not None:
            check_after_cell(replay)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        self._reached(index)
        return super().__getitem__(index)

    def __iter__(self):
        for index in range(len(self)):
            yield self[index]


def run_cases(per_case, learner, world_size, cases, *, exercise, p2p_only=False, group_timeout=None,
              deadline=None, describe=None, advice=None, defaults=None, keep_messages=None):
    """Launch `world_size` ranks once and run every case on them; return runs[case][rank] (CaseRuns).

    per_case: a picklable `per_case(learner, part, ctx) -> dict of plain values`, run in each rank that
    takes part (RankContext); learner: the learner's function or class, handed to it as it is.
    p2p_only: collectives are refused (in the rank's recorder, and by the grader's router).
    group_timeout: seconds a blocked call waits (default: TIMEOUTS["p2p_deadlock"] for point-to-point
    exercises, TIMEOUTS["test_group"] otherwise). describe(run, about) -> str: one line per rank in a
    deadlock message (about: the case's `about`); advice: what it advises (a string, or
    advice(runs, about) -> str given the runs that took part). defaults: values a run has when its
    per-case function did not report them.
    keep_messages: the router keeps what messages and collectives carried (default: when a case has a
    replay, or in point-to-point exercises).
    """
    cases = list(cases)
    for case in cases:
        if case.world_size != world_size:
            raise ValueError(f"{exercise}: a case for {case.world_size} ranks in a launch of {world_size}")
    if group_timeout is None:
        group_timeout = TIMEOUTS["p2p_deadlock"] if p2p_only else TIMEOUTS["test_group"]
    keep = keep_messages if keep_messages is not None else (
        p2p_only or any(case.replay is not None for case in cases))
    mine = per_rank([[case.for_rank(rank, i) for i, case in enumerate(cases)] for rank in range(world_size)])
    options = dict(current_options(), p2p_only=p2p_only, exercise=exercise, keep_messages=keep)
    with launch_options(**options):
        results = launch(rank_loop, world_size, per_case, learner, mine, exercise, p2p_only,
                         group_timeout=group_timeout, deadline=deadline)
    reports = [(result or {}).get("reports") for result in results]
    stopped = [rank for rank, r in enumerate(reports) if r is None]
    memory = observed_memory()
    runs = [[_run_of(case, rank, _report(reports, rank, index), defaults,
                     memory[rank] if memory is not None else None)
             for rank in range(world_size)] for index, case in enumerate(cases)]
    _raise_raised(runs, reports, world_size, stopped)
    failed = [any(r.failure is not None for r in case_runs) for case_runs in runs]
    agree_with_router(runs, observed_traffic(), exercise, failed)
    flow = observed_messages()
    problems = [_problem(case_runs, case, exercise, group_timeout, describe, advice)
                for case, case_runs in zip(cases, runs, strict=True)]
    replays = [_replay(case, case_runs, flow, exercise) for case, case_runs in zip(cases, runs, strict=True)]
    return CaseRuns(runs, problems, replays)


def _report(reports, rank, index):
    mine = reports[rank]
    return mine[index] if mine is not None and index < len(mine) else None


def _run_of(case, rank, report, defaults, memory):
    """The RankRun of one rank in one case; group None when it sat the case out or never reached it."""
    if report is None or report.get("sat_out"):
        return RankRun(rank, None, values=dict(defaults or {}), memory=memory)
    ops = [CommOp.from_row(row) for row in report.get("ops") or ()]
    run = RankRun(rank, members_of(case.groups, rank, case.world_size),
                  values={**(defaults or {}), **(report.get("values") or {})}, ops=ops,
                  failure=tuple(report["failure"]) if report.get("failure") else None,
                  observed=report.get("observed"), memory=memory)
    run.phase_starts = [(name, int(start)) for name, start in report.get("phases") or ()]
    run.phases = _phases(ops, run.phase_starts)
    return run


def _phases(ops, starts):
    """{phase: its calls}: the case's calls cut where each phase starts (before the first: "call")."""
    cuts = [(UNPHASED, 0), *starts, (None, len(ops))]
    phases = {}
    for (name, start), (_, end) in zip(cuts, cuts[1:], strict=False):
        if name == UNPHASED and start == end and starts:
            continue
        phases.setdefault(name, []).extend(ops[start:end])
    return phases


def _raise_raised(runs, reports, world_size, stopped):
    """A learner's exception: the launch error of the first case in which a rank's code raised, blaming
    the lowest rank that raised in it, at once."""
    for case_runs in runs:
        raised = [(run.rank, *run.failure[1:]) for run in case_runs
                  if run.failure is not None and run.failure[0] == "raised"]
        if raised:
            raise reported_failure(world_size, raised, stopped)


def agree_with_router(runs, traffic, exercise, failed):
    """While graded (traffic: per rank the router's CommOps of the launch): each rank's recorded calls,
    in order over the cases, must be the router's, and then become the router's (see the module
    docstring, 3). A failed case may have recorded one trailing call the router never logged: it stays
    as the rank recorded it (what the rank tried is the checks' best clue)."""
    if traffic is None:
        for case_runs in runs:
            for run in case_runs:
                _set_ops(run, [o for o in run.ops if o.op != "barrier"])
        return
    for rank, seen in enumerate(traffic):
        routed = [o for o in seen if o.op != "barrier"]
        mine = [(run, [o for o in run.ops if o.op != "barrier"]) for run in (c[rank] for c in runs)]
        recorded = [o for _, ops in mine for o in ops]
        names, routed_names = [o.op for o in recorded], [o.op for o in routed]
        last_failed = any(failed[i] and runs[i][rank].failure is not None for i in range(len(runs)))
        agree = names == routed_names or (last_failed and len(names) == len(routed_names) + 1
                                          and names[:-1] == routed_names)
        if not agree:
            raise AssertionError(
                f"{exercise}: rank {rank} made {len(routed)} communication call(s) as the grader's router "
                f"saw them ({', '.join(routed_names[:8]) or 'none'}), but recorded {len(recorded)} "
                f"({', '.join(names[:8]) or 'none'}): every collective and message must go through "
                f"torch.distributed where the recorder sees it")
        at = 0
        for run, ops in mine:
            taken = routed[at:at + len(ops)]
            at += len(ops)
            # the call the router refused before logging it (a message to itself) stays as recorded
            _set_ops(run, taken + ops[len(taken):])


def _set_ops(run, ops):
    """Give a run its calls (the router's), with its phases cut at the same places (barriers left out)."""
    kept = [i for i, o in enumerate(run.ops) if o.op != "barrier"]
    starts = [(name, sum(1 for i in kept if i < start)) for name, start in getattr(run, "phase_starts", ())]
    run.ops = list(ops)
    if run.phases or starts:
        run.phases = _phases(run.ops, starts)


def _problem(case_runs, case, exercise, group_timeout, describe, advice):
    """The AssertionError of a case whose ranks could not finish it (raised when it is reached)."""
    where = f" ({case.label})" if case.label else ""
    forbidden = [r for r in case_runs if r.forbidden]
    if forbidden:
        ranks = _names([r.rank for r in forbidden])
        return AssertionError(f"{forbidden[0].forbidden.replace(exercise, exercise + where, 1)} "
                              f"[on rank{'s' if len(forbidden) > 1 else ''} {ranks}]")
    bad = [r for r in case_runs if r.bad_peer]
    if bad:  # before deadlocks: a rank waiting on the rank that refused a bad peer is no deadlock
        return AssertionError(
            f"{exercise}{where} named a rank that does not exist in a send or recv, on "
            f"rank{'s' if len(bad) > 1 else ''} {_names([r.rank for r in bad])}:\n"
            + "\n".join(f"  {r.bad_peer}" for r in bad))
    stuck = [r for r in case_runs if r.stuck]
    if not stuck:
        return None
    group = members(case_runs)
    lines = []
    for r in group:
        if describe is not None:
            lines.append(f"  {describe(r, case.about)}")
        elif r.stuck:
            lines.append(f"  rank {r.rank}: blocked {r.stuck}")
        else:
            lines.append(f"  rank {r.rank}: finished its call ({len(r.sends)} send(s), "
                         f"{len(r.ops) - len(r.sends)} recv(s))")
    advised = advice(group, case.about) if callable(advice) else advice
    return AssertionError(
        f"{exercise}{where} deadlocked: rank{'s' if len(stuck) > 1 else ''} "
        f"{_names([r.rank for r in stuck])} of {len(group)} waited {group_timeout:g} s for a "
        f"partner that never came:\n" + "\n".join(lines) + "\n" + (advised or deadlock_advice(group)))


def _replay(case, case_runs, flow, exercise):
    """The deferred provenance check of a case, or None (not graded, or nothing to replay)."""
    if case.replay is None or observed_traffic() is None:
        return None
    what = exercise + (f" ({case.label})" if case.label else "")
    events = case_events(case_runs, flow)
    return lambda: case.replay.check(case_runs, events, what)


def case_events(case_runs, flow):
    """What the router saw of one case, in order: ("post", src, dst, id, tensor) and ("deliver", src,
    dst, id, tensor) of each message (the router's flow, kept to this case's messages), then
    ("collective", group, {member: its CommOp}) for each collective, in the order they started
    (CommOp.payload: what each member put in). A case mixes no messages and collectives."""
    ids = {getattr(o, "message", None) for r in case_runs for o in r.ops if o.op == "send"} - {None}
    events = [event for event in flow or () if event[3] in ids]
    calls = {}  # (group, k) -> {rank: CommOp}: the k-th collective of each member on that group
    for run in case_runs:
        counts = {}
        for o in run.ops:
            if o.op in ("send", "recv", "barrier") or getattr(o, "payload", None) is None:
                continue
            k = counts[o.group] = counts.get(o.group, -1) + 1
            calls.setdefault((o.group, k), {})[run.rank] = o
    ordered = sorted(calls.items(), key=lambda item: min(o.start for o in item[1].values()))
    return events + [("collective", group, ops) for (group, _), ops in ordered]


# --------------------------------------------------------------------------- one run of a few steps

def splits(case_of):
    """Declare how the arguments of a run are split into its Case: `case_of(world_size, *args, **kwargs)`
    (caller side) says what each rank is sent; the decorated per-case function runs it in the rank.
    Such a run is started with `launch_run`. Used by notebooks 10 and 11, whose runs train a few steps."""
    def mark(per_case):
        per_case.case_of = case_of
        return per_case
    return mark


def launch_run(run, world_size, learner, *args, explain=None, group_timeout=TIMEOUTS["test_group"],
               deadline=None, **kwargs):
    """Run `run` (a per-case function declared with `splits`) once on world_size ranks, each sent its part
    of run.case_of(world_size, *args, **kwargs); one dict per rank: what the rank's run returned, and
    under "ops" every call it made (the router's while graded) but those of a "setup" phase.

    A rank whose code raised, or a case that could not finish (a deadlock), becomes an AssertionError whose
    first line says which exercise on how many ranks, then what happened, then `explain(error)` (a
    diagnosis, or "")."""
    name = getattr(learner, "name", None) or getattr(learner, "__name__", "your code")
    case = run.case_of(world_size, *args, **kwargs)
    try:
        (runs,) = run_cases(run, learner, world_size, [case], exercise=name, group_timeout=group_timeout,
                            deadline=deadline)
    except LaunchError as error:
        first, _, rest = str(error).partition("\n")
        hint = explain(error) if explain is not None else ""
        raise AssertionError(f"{name} on {world_size} rank(s): {first}{hint}\n{rest}") from None
    return [dict(r.values, ops=[o for name, ops in r.phases.items() if name != SETUP for o in ops])
            for r in runs]


# --------------------------------------------------------------------------- deadlock advice

RING_ADVICE = (
    "A blocking dist.send returns only once its peer has posted the matching recv (and a recv "
    "once a matching send arrives): if every rank sends first, or every rank receives first, "
    "they wait in a circle. Order the calls so a partner is always posted (even ranks send "
    "first, odd ranks receive first), or post isend/irecv together and then wait.")


PEER_ADVICE = (
    "Not every rank is blocked in the same kind of call, so this is no circle of ranks that all send "
    "(or all receive) first: a send or recv names a peer that never posts the matching call. For each "
    "blocked rank above, check that the rank it names calls the matching recv (or send) with this rank "
    "as its peer, as many times.")


COLLECTIVE_ADVICE = (
    "Every rank of a group must make the same collectives in the same order: a rank that skips one, "
    "or calls another, leaves its peers waiting.")


def deadlock_advice(group):
    """RING_ADVICE only when it is the cause -- every rank of the group blocked in a send, or every
    one in a recv -- COLLECTIVE_ADVICE when ranks waited in collectives, else PEER_ADVICE: a wrong
    peer or a missing call leaves ranks blocked in different calls, or some finished while others
    wait."""
    kinds = {r.stuck.split()[1] if r.stuck and r.stuck.startswith("in ") else None for r in group}
    kinds = {k.rstrip("()") if k else k for k in kinds}
    if len(kinds) == 1 and kinds <= {"send", "recv"}:
        return RING_ADVICE
    if kinds - {None, "send", "recv", "isend", "irecv", "wait"}:
        return COLLECTIVE_ADVICE
    return PEER_ADVICE


def _names(ranks):
    names = [str(r) for r in ranks]
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]


def shares_memory(result, x):
    """True when a function returned its input, or a view of it, instead of a new tensor: only the rank
    can tell (what travels back is a copy either way)."""
    if not (isinstance(result, torch.Tensor) and isinstance(x, torch.Tensor)):
        return False
    return result.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
