"""Run a communication exercise on ranks under the recorder, and judge values, messages and bytes.

    calls = run_p2p(ring_shift, [torch.full((3,), float(r)) for r in range(4)], exercise="ring_shift")
    calls[2].result, calls[2].after, calls[2].ops      # what rank 2 returned, its input after, its calls
    expect_ring_traffic(calls, numel=3, element_size=4, phases=2, what="ring_all_reduce")

Why a module: the exercises of notebooks 03-04 are graded on three things -- the values
each rank ends with, that only point-to-point calls were used (a collective would do the
work for you), and how many messages and bytes each rank sent (a ring is *defined* by
them). Each rank runs the learner's function inside `CommRecorder(p2p_only=True)`, so the
same recorder that forbids `dist.all_reduce` and the process-group bypass also counts
every `send` and `recv` with its peer and size.

A deadlock must end in seconds with a sentence naming the ranks and the call each was
stuck in, not with gloo's internals: every rank catches its own timeout ("Timed out
waiting 3000ms for recv") or the "connection closed" it gets once a peer gives up, and
reports which call it was blocked in. The caller turns that into one AssertionError.

Exercises whose ranks need more than one input tensor (a pipeline stage needs its layers,
its neighbours and the batch) hand `run_cases` a `prepare(rank, case)` that builds the
rank's arguments inside the rank, and may watch the call (`Prepared.watch`: what it saw
lands in `Call.observed`, and it says where in its work a rank was when it raised).
`describe(call, case)` then names each rank's part of a deadlock in the exercise's terms
("stage 1 ... the activation of micro-batch 2"). Notebook 07 runs its pipelines this way.
"""

import functools
import re
import traceback
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dpcourse.backend import rank_device
from dpcourse.comm.provenance import expect_derived
from dpcourse.comm.recorder import CommOp, CommRecorder, ForbiddenCollective, PeerError
from dpcourse.runtime.failures import LaunchError
from dpcourse.runtime.inside_rank import to_cpu
from dpcourse.runtime.launcher import (
    check_after_cell,
    current_runner,
    launch,
    launch_options,
    observed_messages,
    observed_traffic,
    per_rank,
)
from dpcourse.runtime.timeouts import TIMEOUTS

GROUP_TIMEOUT = TIMEOUTS["p2p_deadlock"]  # seconds a blocked send/recv waits: then it is a deadlock


WAITED = re.compile(r"timed out|timeout|closed by peer|connection reset|broken pipe|connection closed"
                    r"|socket closed|connection refused", re.I)


@dataclass
class Call:
    """What one rank did in one call of the learner's function."""

    rank: int  # rank in the world
    group_rank: int | None  # rank in the group the call ran on; None: not a member, did not call
    group_members: list | None = None  # world ranks of that group, in group-rank order
    result: object = None  # what the function returned
    after: object = None  # the first argument as the call left it (in-place functions)
    expected: object = None  # the reference computed with a built-in collective, if asked
    ops: list = field(default_factory=list)  # CommOp list: op, peer (group rank), nbytes
    stuck: str | None = None  # "in recv from rank 3 (`dist.recv(buf, left)`)" after a timeout
    forbidden: str | None = None  # the ForbiddenCollective message
    bad_peer: str | None = None  # a send/recv to a rank that does not exist (refused before the backend)
    observed: dict | None = None  # what a Prepared.watch saw in the rank (None without one)
    aliases_input: bool = False  # the result shares memory with the rank's input (x itself, a view)

    @property
    def group_size(self):
        return len(self.group_members or ())

    @property
    def sends(self):
        return [o for o in self.ops if o.op == "send"]

    @property
    def sent_bytes(self):
        return sum(o.nbytes for o in self.sends)


def run_p2p(fn, inputs, *, exercise, args=(), kwargs=None, reference=None, groups=None,
            group_timeout=GROUP_TIMEOUT, deadline=None, label=None):
    """Launch len(inputs) ranks; rank r calls fn(inputs[r], *args, **kwargs) with p2p only.

    inputs[r] goes to rank r's device and is cloned, so `Call.after` shows what an in-place
    function did to it. reference="all_reduce" also gives each Call the expected value: what
    `dist.all_reduce` leaves (the inputs of the group's ranks added up, worked out here).
    groups: lists of world ranks; each rank calls fn with `group=` the group it belongs to.
    Returns one Call per world rank; raises an AssertionError naming ranks and calls on a
    deadlock or a collective.
    """
    case = dict(inputs=list(inputs), args=tuple(args), kwargs=dict(kwargs or {}), reference=reference,
                groups=groups, label=label)
    return next(run_cases(fn, len(inputs), [case], exercise=exercise, group_timeout=group_timeout,
                          deadline=deadline))


@dataclass
class Prepared:
    """What a `prepare(rank, case)` function returns inside a rank: fn's arguments and a watch.

    watch: None, or a context manager entered around the call with `observed()` (a dict of
    plain values, stored in Call.observed even when the call failed), `where()` (a few words
    on where the rank was in its work, added to the message of an exception) and optionally
    `hint(exception)` (a sentence appended to that message, or "").
    """

    args: tuple
    kwargs: dict = field(default_factory=dict)
    watch: object = None


def run_cases(fn, world_size, cases, *, exercise, group_timeout=GROUP_TIMEOUT, deadline=None,
              prepare=None, describe=None, advice=None):
    """Several cases on the same ranks in one launch (a launch costs ~0.1-0.5 s, a case ~ms).

    Each case is a dict like run_p2p's arguments: inputs (one per world rank), args, kwargs,
    reference, groups, label. Yields, case by case, the list of Calls (one per world rank);
    a deadlock or a collective in a case raises when that case is reached, so a caller that
    checks each case as it comes reports the first thing that went wrong.

    What a rank reports is only what the learner's code produced (result, tensor after the
    call, where it got stuck); who belongs to which group and the expected values are worked
    out here, in the caller. While grading, each case is a launch of its own and the messages
    come from the grader's router, which counts them outside the ranks.

    prepare: a picklable `prepare(rank, case) -> Prepared`, run inside each rank, that builds
    fn's arguments instead of handing fn its input tensor (the case then needs no `inputs`);
    None makes the rank sit the case out (cases of different sizes share one launch).
    describe: `describe(call, case) -> str`, one line per rank in a deadlock message.
    advice: what a deadlock message advises, in place of the ring exercises' advice: a string, or
    `advice(group, case) -> str` given the Calls of the ranks that took part (to advise by diagnosis).
    """
    describe_case = (lambda case: None) if describe is None else (
        lambda case: lambda call: describe(call, case))
    advise = (lambda case: lambda group: advice(group, case)) if callable(advice) else (lambda case: advice)
    if current_runner() is not None:  # graded: one launch per case, traffic as the router saw it
        for case in cases:
            mine = per_rank([[own_part(case, rank)] for rank in range(world_size)])
            with launch_options(p2p_only=True, exercise=exercise):
                per_rank_reports = launch(_rank_side, world_size, fn, mine, exercise, prepare,
                                          group_timeout=group_timeout, deadline=deadline)
            traffic = observed_traffic()
            for reports in per_rank_reports:
                if reports:
                    reports[0]["ops"] = None
            calls = _calls_of(case, [r[0] if r else None for r in per_rank_reports], traffic)
            _raise_problems(calls, exercise, case.get("label"), group_timeout, describe_case(case),
                            advise(case))
            if isinstance(case, dict) and case.get("inputs") is not None:
                what = exercise + (f" ({case['label']})" if case.get("label") else "")
                check_after_cell(functools.partial(expect_derived, calls, list(case["inputs"]),
                                                   observed_messages(), what))
            yield calls
        return
    everyone = launch(_rank_side, world_size, fn, cases, exercise, prepare, group_timeout=group_timeout,
                      deadline=deadline)
    for index, case in enumerate(cases):
        reports = [rank_reports[index] if index < len(rank_reports) else None for rank_reports in everyone]
        calls = _calls_of(case, reports, None)
        _raise_problems(calls, exercise, case.get("label"), group_timeout, describe_case(case),
                        advise(case))
        yield calls


def own_part(case, rank):
    """What rank `rank` is sent of a case while graded: its own input only, never its peers' (each
    rank learns the others' data from messages, as on a real cluster). A case built by `prepare`
    says what each rank may see with its "own_part" (a picklable own_part(case, rank), e.g. a
    pipeline's: only the rank's own stage); one without it is sent whole."""
    if isinstance(case, dict) and callable(case.get("own_part")):
        return case["own_part"](case, rank)
    if not isinstance(case, dict) or "inputs" not in case:
        return case
    inputs = case["inputs"]
    return dict(case, inputs=[x if r == rank else None for r, x in enumerate(inputs)])


def world_peer(op):
    """The world rank a send went to / a recv came from."""
    return op.world_peer


def _members_of(case, rank, world_size):
    groups = case.get("groups")
    if groups is None:
        return list(range(world_size))
    return next((list(m) for m in groups if rank in m), None)


def _calls_of(case, reports, traffic):
    """One Call per world rank: membership and expected values from the case, the rest reported."""
    world_size = len(reports)
    calls = []
    for rank, report in enumerate(reports):
        members = _members_of(case, rank, world_size)
        call = Call(rank, None)
        calls.append(call)
        if members is None or report is None or report.get("sat_out"):
            continue
        call.group_rank, call.group_members = members.index(rank), members
        call.result, call.after = report.get("result"), report.get("after")
        call.stuck, call.forbidden = report.get("stuck"), report.get("forbidden")
        call.bad_peer = report.get("bad_peer")
        call.observed = report.get("observed")
        call.aliases_input = bool(report.get("aliases_input"))
        if traffic is not None:
            call.ops = list(traffic[rank])
        else:
            call.ops = [CommOp(*fields) for fields in report.get("ops") or ()]
        if case.get("reference") == "all_reduce":
            call.expected = _sum_over(case["inputs"], members)
    return calls


def _sum_over(inputs, members):
    """What dist.all_reduce (SUM) leaves on every member: the inputs added in member order."""
    total = inputs[members[0]].detach().cpu().clone()
    for m in members[1:]:
        total = total + inputs[m].detach().cpu()
    return total


def _rank_side(fn, cases, exercise, prepare=None):
    """Runs on every rank: each case in order, stopping at the first one that went wrong.

    Reports plain values only (what the learner's function returned, its first argument after
    the call, where it got stuck, its calls as the in-rank recorder saw them, what a watch saw).
    """
    rank, reports = dist.get_rank(), []
    for case in cases:
        group, members = _make_group(case.get("groups"), rank)
        if members is None:
            reports.append({})
            continue
        report = {}
        reports.append(report)
        if prepare is None:
            x = _to_device(case["inputs"][rank])
            args, kwargs, watch = (x, *case.get("args", ())), dict(case.get("kwargs") or {}), None
        else:
            prepared = prepare(rank, case)
            if prepared is None:  # this rank sits the case out
                report["sat_out"] = True
                continue
            x, args, kwargs, watch = None, tuple(prepared.args), dict(prepared.kwargs), prepared.watch
        if case.get("groups") is not None:
            kwargs["group"] = group
        recorder = CommRecorder(p2p_only=True, exercise=exercise)
        try:
            with watch if watch is not None else nullcontext(), recorder:
                report["result"] = fn(*args, **kwargs)
        except ForbiddenCollective as exc:
            report["forbidden"] = str(exc)
        except PeerError as exc:  # reported by every rank that made it, in rank order: no race to blame
            where = f"rank {rank}, {watch.where()}" if watch is not None and hasattr(watch, "where") else \
                f"rank {rank}"
            hint = watch.hint(exc) if watch is not None and hasattr(watch, "hint") else ""
            report["bad_peer"] = f"{where}: {exc}{hint}"
        except Exception as exc:  # a timeout or a vanished peer is a deadlock; anything else is a bug
            if isinstance(exc, RuntimeError) and "Pair is not connected" in str(exc):
                raise RuntimeError(f"{exercise}: rank {rank} sent to or received from itself (gloo: \"Pair "
                                   f"is not connected\"): a rank has no connection to itself; on a single "
                                   f"rank there is nobody to talk to") from exc
            if not (isinstance(exc, RuntimeError) and WAITED.search(str(exc))):
                if watch is not None and isinstance(exc, NotImplementedError):
                    # the same message on every rank, so no race on which rank a grade names (the launcher
                    # adds "not written yet")
                    raise NotImplementedError(exercise) from exc
                if watch is not None and hasattr(watch, "where"):
                    hint = watch.hint(exc) if hasattr(watch, "hint") else ""
                    raise RuntimeError(f"{exercise} on rank {rank}, {watch.where()}: "
                                       f"{type(exc).__name__}: {exc}{hint}") from exc
                raise
            report["stuck"] = _blocked_in(exc, recorder.ops)
        finally:
            if watch is not None:
                report["observed"] = to_cpu(watch.observed())
        report["ops"] = [[o.op, o.peer, o.nbytes, o.start, o.end, o.group] for o in recorder.ops]
        report["aliases_input"] = _shares_memory(report.get("result"), x)
        report["result"], report["after"] = to_cpu(report.get("result")), to_cpu(x)
        if report.get("stuck") or report.get("forbidden") or report.get("bad_peer"):
            break  # peers will not match the next case's calls: stop here, report this one
    return reports


def _shares_memory(result, x):
    """True when the function returned its input, or a view of it, instead of a new tensor: only
    the rank can tell (what travels back is a copy either way)."""
    if not (isinstance(result, torch.Tensor) and isinstance(x, torch.Tensor)):
        return False
    return result.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


def _make_group(groups, rank):
    """Create every group (all ranks must take part), return (this rank's group, its members)."""
    if groups is None:
        return None, list(range(dist.get_world_size()))
    mine = (None, None)
    for members in groups:
        group = dist.new_group(list(members))
        if rank in members:
            mine = (group, list(members))
    return mine


def _to_device(value):
    return value.to(rank_device()).clone() if isinstance(value, torch.Tensor) else value


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
        return f"in {call} {direction} rank {world_peer(last)}{where}"
    recent = ", ".join(f"{o.op} {'to' if o.op == 'send' else 'from'} rank {world_peer(o)}" for o in ops[-2:])
    return f"in {call}(){where}" + (f", after {recent}" if recent else "")


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


def deadlock_advice(group):
    """RING_ADVICE only when it is the cause -- every rank of the group blocked in a send, or every
    one in a recv -- else PEER_ADVICE: a wrong peer or a missing call leaves ranks blocked in
    different calls, or some finished while others wait."""
    kinds = {c.stuck.split()[1] if c.stuck and c.stuck.startswith("in ") else None for c in group}
    kinds = {k.rstrip("()") if k else k for k in kinds}
    if len(kinds) == 1 and kinds <= {"send", "recv"}:
        return RING_ADVICE
    return PEER_ADVICE


def _raise_problems(calls, exercise, label, group_timeout, describe=None, advice=None):
    where = f" ({label})" if label else ""
    forbidden = [c for c in calls if c is not None and c.forbidden]
    if forbidden:
        ranks = _names([c.rank for c in forbidden])
        raise AssertionError(f"{forbidden[0].forbidden.replace(exercise, exercise + where, 1)} "
                             f"[on rank{'s' if len(forbidden) > 1 else ''} {ranks}]")
    bad = [c for c in calls if c is not None and c.bad_peer]
    if bad:  # before deadlocks: a rank waiting on the rank that refused a bad peer is no deadlock
        raise AssertionError(
            f"{exercise}{where} named a rank that does not exist in a send or recv, on "
            f"rank{'s' if len(bad) > 1 else ''} {_names([c.rank for c in bad])}:\n"
            + "\n".join(f"  {c.bad_peer}" for c in bad))
    stuck = [c for c in calls if c is not None and c.stuck]
    if stuck:
        group = members(calls)
        lines = []
        for c in group:
            if describe is not None:
                lines.append(f"  {describe(c)}")
            elif c.stuck:
                lines.append(f"  rank {c.rank}: blocked {c.stuck}")
            else:
                lines.append(f"  rank {c.rank}: finished its call ({len(c.sends)} send(s), "
                             f"{len(c.ops) - len(c.sends)} recv(s))")
        raise AssertionError(
            f"{exercise}{where} deadlocked: rank{'s' if len(stuck) > 1 else ''} "
            f"{_names([c.rank for c in stuck])} of {len(group)} waited {group_timeout:g} s for a "
            f"partner that never came:\n" + "\n".join(lines) + "\n"
            + ((advice(group) if callable(advice) else advice) or deadlock_advice(group)))


def _names(ranks):
    names = [str(r) for r in ranks]
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]


def members(calls):
    """The calls of the ranks that took part (a case on a sub-group leaves the others out)."""
    return [c for c in calls if c is not None and c.group_rank is not None]


def plain_ops(ops):
    """CommOp records as plain lists, as a graded rank may return them (launch_run turns them back)."""
    return [[o.op, o.peer, o.nbytes, o.start, o.end, o.group] for o in ops]


def launch_run(run, world_size, learner, *args, explain=None, group_timeout=TIMEOUTS["test_group"], **kwargs):
    """launch(run, world_size, learner, *args, **kwargs) for a test cell (notebooks 10 and 11).

    Each result's "ops" (plain lists, see plain_ops) becomes the rank's whole communication in the
    run as the grader's router saw it when graded (launcher.observed_traffic), else as the rank's
    own recorder saw it, as CommOp records. A LaunchError becomes an AssertionError whose first
    line says which rank failed, and how, followed by `explain(error)` (a diagnosis, or "").
    """
    try:
        results = launch(run, world_size, learner, *args, group_timeout=group_timeout, **kwargs)
    except LaunchError as error:
        name = getattr(learner, "name", None) or getattr(learner, "__name__", "your code")
        first, _, rest = str(error).partition("\n")
        hint = explain(error) if explain is not None else ""
        raise AssertionError(f"{name} on {world_size} rank(s): {first}{hint}\n{rest}") from None
    traffic = observed_traffic()
    for rank, result in enumerate(results):
        if isinstance(result, dict) and "ops" in result:
            recorded = [CommOp(*fields) for fields in result["ops"]]
            result["ops"] = list(traffic[rank]) if traffic is not None else recorded
    return results
