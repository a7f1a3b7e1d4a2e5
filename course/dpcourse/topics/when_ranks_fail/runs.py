"""Run a learner's fault-tolerance code on ranks; plain reports back, one per case and rank.

    runs = run_resume(learner, 2, [case], exercise="save_checkpoint")        # exercises 1 and 2
    runs = run_restarts(train_job, 2, [case], exercise="train_job")           # exercise 3
    runs = run_heartbeats(Heartbeat, 3, [case], exercise="Heartbeat")         # exercise 4
    runs = run_guarded(learner, 3, [case], exercise="diverged_ranks")         # exercise 5
    runs = run_timed(time_steps, 3, [case], exercise="time_steps")            # exercise 6

Why a module: notebook 14's visible tests, hidden checks and demos run the learner's code the same
way, and the grader needs it written like this. The rank side is one function per kind of case,
`case_fn(learner, part) -> plain dict`, where `part = own_part(case, rank)` is only what that rank
may see (its own faults; the job and the folder are everyone's); `each_part` runs a rank's parts in
turn and reports a failure as a value ({"error": [where, what]}), after which the rank stops (its
peers would not match its calls); the caller raises for the lowest rank that failed. Every launch
goes through `dpcourse.runtime.launcher.launch(..., per_rank(parts))`.

Folders: a test hands a launch one existing folder (`tempfile.mkdtemp()`: while graded, the only
writable place the ranks of a launch share) and the ranks work in sub-folders of it, made with
umask 0: while graded each rank runs as a user of its own, and every rank writes its own shard
into the same checkpoint folder.

Restarts: `run_restarts` is the course's elastic agent. Like torchrun's (`LocalElasticAgent._invoke_run`
in torch/distributed/elastic/agent/server/api.py), when a rank of the job dies it stops every rank and
starts the whole job again, at most `max_restarts` times, telling it which attempt this is (torchrun's
TORCHELASTIC_RESTART_COUNT); what survives a restart is what is on disk. It restarts only after the
failure it injected (a SIGKILL of the rank the case names): any other failure is the learner's, and
is reported at once.
"""

import os
import random
import time
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from dpcourse.runtime.failures import VICTIM, WAITED, LaunchError
from dpcourse.runtime.inside_rank import to_cpu
from dpcourse.runtime.launcher import launch, per_rank
from dpcourse.runtime.timeouts import TIMEOUTS
from dpcourse.topics.when_ranks_fail.job import Fault, ShardSampler, Trainer, rank_seeds

HANG_TIMEOUT = 1.0  # seconds a collective waits for a stuck rank in the hang cases (the watchdog's trigger)


class LearnerError(Exception):
    """The learner's code raised in a rank: reported as a value, the caller names the lowest rank."""

    def __init__(self, where, what):
        super().__init__(f"{where}: {what}")
        self.where, self.what = where, what


def guarded(exercise, label, fn, *args, **kwargs):
    """fn(*args, **kwargs); what it raises becomes a LearnerError saying where (a fault passes through)."""
    try:
        return fn(*args, **kwargs)
    except (Fault, LearnerError):
        raise
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        raise LearnerError(f"{exercise} ({label})", said(exc)) from exc


def said(exc):
    """'<type>: <first line>' of an exception; for DCP's CheckpointException, of the first rank's failure
    inside it (its own text is only 'CheckpointException ranks:dict_keys([...])')."""
    if isinstance(exc, CheckpointException) and exc.failures:
        rank, (inner, _) = sorted(exc.failures.items(), key=lambda item: item[0])[0]
        return f"CheckpointException (rank {rank}): {said(inner)}"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:400]}" if text else type(exc).__name__


def own_part(case, rank):
    """What rank `rank` may see of `case`: everything but the other ranks' faults."""
    part = {k: v for k, v in case.items() if k != "faults"}
    part["faults"] = [dict(f) for f in case.get("faults", ()) if f["rank"] == rank]
    return part


def each_part(case_fn, learner, parts, folder, exercise):
    """A rank's side of a launch: case_fn(learner, part) for each of its parts in turn (see the module
    docstring). `folder`: the launch's shared folder (a plain argument, so the grader shares it)."""
    os.umask(0)
    torch.set_num_threads(1)
    reports = []
    for part in parts:
        part = dict(part, folder=os.path.join(folder, part["name"]) if folder else None)
        if part["folder"]:
            os.makedirs(part["folder"], exist_ok=True)
        try:
            reports.append(to_cpu(case_fn(learner, part)))
        except LearnerError as exc:
            reports.append({"error": [exc.where, exc.what]})
            break
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - the course's own code failing too
            kind = "waited" if WAITED.search(str(exc)) or VICTIM.search(str(exc)) else "error"
            reports.append({kind: [f"{exercise} ({part.get('label', part['name'])})", said(exc)]})
            break
    return reports


def named(cases, prefix="case"):
    """The cases with a `name` each (their folder's name): prefix0, prefix1, ..."""
    return [dict(case, name=case.get("name", f"{prefix}{i}")) for i, case in enumerate(cases)]


def launch_parts(case_fn, learner, world_size, cases, folder, exercise, group_timeout=None, deadline=None):
    """Launch `world_size` ranks over `cases`; [case][rank] reports. A learner error raises AssertionError
    naming the lowest rank that failed (a rank that waited for a failed peer is not blamed)."""
    parts = [[own_part(case, rank) for case in cases] for rank in range(world_size)]
    per_rank_reports = launch(each_part, world_size, case_fn, learner, per_rank(parts), folder, exercise,
                              backend="gloo", group_timeout=group_timeout or TIMEOUTS["test_group"],
                              deadline=deadline)
    raise_first_error(per_rank_reports, exercise)
    return [[per_rank_reports[rank][i] for rank in range(world_size)] for i in range(len(cases))]


def raise_first_error(per_rank_reports, exercise):
    for rank, reports in enumerate(per_rank_reports):
        for report in reports:
            if report.get("error"):
                where, what = report["error"]
                raise AssertionError(f"{where} raised on rank {rank}: {what}")
    waited = [rank for rank, reports in enumerate(per_rank_reports) for r in reports if r.get("waited")]
    if waited:
        where, what = next(r["waited"] for reports in per_rank_reports for r in reports if r.get("waited"))
        raise AssertionError(f"{where}: rank(s) {sorted(set(waited))} waited in vain for their peers "
                             f"({what}): "
                             f"every rank must make the same collective calls in the same order")


# --------------------------------------------------------------------------- 1-2. resume exactly, elsewhere

def _first_half(learner, part):
    """Train the uninterrupted run (when asked) and, in a fresh trainer, the first `stop` steps, then save."""
    label, report = part.get("label", part["name"]), {}
    sampler = learner.get("sampler") or ShardSampler
    if part.get("uninterrupted"):
        whole = Trainer(part["job"], sampler=sampler)
        while whole.step < part["job"]["steps"]:
            whole.train_step()
        report["uninterrupted"] = whole.report()
    trainer = guarded(part["exercise"], label, Trainer, part["job"], sampler=sampler)
    while trainer.step < part["stop"]:
        trainer.train_step()
    started = time.perf_counter()
    guarded(part["exercise"], label, learner["save"], os.path.join(part["folder"], "checkpoint"), trainer)
    report["save_seconds"] = time.perf_counter() - started
    report["first"] = trainer.report()
    return report


def _second_half(learner, part):
    """A fresh trainer (a new process: nothing survives but the files) loads the checkpoint and trains on."""
    label = part.get("label", part["name"])
    sampler = learner.get("sampler") or ShardSampler
    forget = part.get("forget", "nothing")
    fresh = Trainer(part["job"], sampler=sampler) if forget != "nothing" else None  # before: it seeds
    trainer = guarded(part["exercise"], label, Trainer, part["job"], sampler=sampler)
    started = time.perf_counter()
    guarded(part["exercise"], label, learner["load"], os.path.join(part["folder"], "checkpoint"), trainer)
    loaded = time.perf_counter() - started
    if fresh is not None:
        FORGET[forget](trainer, fresh)
    restored = {"step": trainer.step, "lr": trainer.optimizer.param_groups[0]["lr"],
                "exp_avg": trainer.optimizer.exp_avg.clone(),
                "exp_avg_sq": trainer.optimizer.exp_avg_sq.clone(),
                "opt_bounds": list(trainer.optimizer.bounds), "params": trainer.flat_parameters()}
    while trainer.step < part["job"]["steps"]:
        trainer.train_step()
    return {"restored": restored, "resumed": trainer.report(), "load_seconds": loaded}


def _forget_torch(trainer, fresh):
    torch.manual_seed(rank_seeds(trainer.job, trainer.rank)["torch"])


def _forget_python(trainer, fresh):
    random.seed(rank_seeds(trainer.job, trainer.rank)["python"])


# What a demo throws away right after load_checkpoint (put back as a fresh trainer has it): notebook 14's
# picture of what each piece of state does. `fresh` is a newly built trainer of the same job.
FORGET = {
    "torch's random state": _forget_torch,
    "Python's random": _forget_python,
    "the generator": lambda trainer, fresh: trainer.generator.set_state(fresh.generator.get_state()),
    "the sampler": lambda trainer, fresh: trainer.sampler.load_state_dict(fresh.sampler.state_dict()),
    "the schedule": lambda trainer, fresh: trainer.scheduler.load_state_dict(fresh.scheduler.state_dict()),
    "the optimizer": lambda trainer, fresh: trainer.optimizer.load_state_dict(fresh.optimizer.state_dict()),
}


def run_resume(learner, world_size, cases, *, exercise, resume_on=None, folder):
    """Each case: a job trained for `stop` steps on `world_size` ranks and checkpointed with
    learner["save"], then, in a new launch on `resume_on` ranks (default: the same), loaded with
    learner["load"] and trained to the end; with `uninterrupted`, the first launch also trains the
    whole job without a break. learner: {"save", "load"[, "sampler": the sampler class]}.

    Returns [case] {"first": [rank] report, "uninterrupted": [rank] report or None, "restored": [rank]
    what the load left, "resumed": [rank] report, "save_seconds", "load_seconds": [rank]}."""
    cases = [dict(case, exercise=exercise) for case in named(cases)]
    first = launch_parts(_first_half, learner, world_size, cases, folder, exercise)
    try:
        second = launch_parts(_second_half, learner, resume_on or world_size, cases, folder, exercise)
    except AssertionError as error:
        if (resume_on or world_size) == world_size or "mismatch" not in str(error):
            raise
        raise AssertionError(f"{error} -- the checkpoint was written by {world_size} ranks and is loaded by "
                             f"{resume_on}: a piece one rank saved does not fit another world size's "
                             "piece, so the "
                             "optimizer state must be resharded (keep it as the optimizer's DTensors, "
                             "and load "
                             f"into the new trainer's own state_dict)") from None
    out = []
    for case_first, case_second in zip(first, second, strict=True):
        out.append({"first": [r["first"] for r in case_first],
                    "uninterrupted": ([r["uninterrupted"] for r in case_first]
                                      if "uninterrupted" in case_first[0] else None),
                    "restored": [r["restored"] for r in case_second],
                    "resumed": [r["resumed"] for r in case_second],
                    "save_seconds": [r["save_seconds"] for r in case_first],
                    "load_seconds": [r["load_seconds"] for r in case_second]})
    return out


def _sampler_case(learner, part):
    """The learner's sampler alone: `draws` batches at world size N, its state, then the next batches of a
    sampler built for world size M that loaded that state; and what a global batch that does not split
    raises."""
    from dpcourse.checks.core import what_it_raises

    cls, job, label = learner["sampler"], part["job"], part.get("label", part["name"])
    rank, world = dist.get_rank(), dist.get_world_size()
    sampler = guarded(part["exercise"], label, cls, job["samples"], job["global_batch"], job["seed"], rank,
                      world)
    before = [torch.as_tensor(guarded(part["exercise"], label, sampler.next_batch)).tolist()
              for _ in range(part["draws"])]
    state = guarded(part["exercise"], label, sampler.state_dict)
    report = {"before": before, "state": state}
    for world_after in part.get("then", ()):
        shares = []
        for r in range(world_after):  # every rank of the new world size, built here: a sampler is local
            other = guarded(part["exercise"], label, cls, job["samples"], job["global_batch"], job["seed"], r,
                            world_after)
            guarded(part["exercise"], label, other.load_state_dict, state)
            shares.append([torch.as_tensor(other.next_batch()).tolist() for _ in range(part["draws_after"])])
        report[f"after_{world_after}"] = shares
    if part.get("uneven"):
        batch, ranks = part["uneven"]
        report["uneven"] = what_it_raises(cls, job["samples"], batch, job["seed"], 0, ranks)
    return report


def run_sampler(sampler_cls, world_size, cases, *, exercise):
    """[case][rank] reports of `_sampler_case`."""
    cases = [dict(case, exercise=exercise) for case in named(cases)]
    return launch_parts(_sampler_case, {"sampler": sampler_cls}, world_size, cases, None, exercise)


# --------------------------------------------------------------------------- 3. restarts

def _uninterrupted(learner, part):
    trainer = Trainer(part["job"])
    while trainer.step < part["job"]["steps"]:
        trainer.train_step()
    return trainer.report()


def run_uninterrupted(job, world_size, name="reference"):
    """[rank] reports of the job trained without a break by the course's own loop (no learner code)."""
    return launch_parts(_uninterrupted, None, world_size, [{"job": job, "name": name}], None,
                        "the uninterrupted run")[0]


def _attempt(learner, part):
    """One attempt of a restarting job: the learner's train_job on a trainer that carries this rank's
    faults for this attempt (a SIGKILL at a step and place: the rank dies there, mid-step)."""
    make_trainer = partial(Trainer, part["job"], faults=part["faults"])
    report = guarded(part["exercise"], part.get("label", part["name"]), learner, make_trainer,
                     part["folder"], part["interval"])
    if not isinstance(report, dict):
        raise LearnerError(f"{part['exercise']} ({part.get('label', part['name'])})",
                           f"returned {type(report).__name__}, expected the dict of trainer.report() with "
                           f"'resumed_from'")
    return report


def checkpoints_in(folder):
    """{name: complete?} of the checkpoint folders (step-NNNNNN) in `folder`: complete = has .metadata."""
    if not os.path.isdir(folder):
        return {}
    return {name: os.path.exists(os.path.join(folder, name, ".metadata"))
            for name in sorted(os.listdir(folder)) if os.path.isdir(os.path.join(folder, name))}


def tear(folder, name):
    """Make checkpoint `name` look like one whose writing was cut short: its shards stay, its .metadata
    (which DCP writes last, once every rank's shard is written) goes."""
    metadata = os.path.join(folder, name, ".metadata")
    if os.path.exists(metadata):
        os.remove(metadata)


def run_restarts(train_job, world_size, case, *, exercise, folder, max_restarts=3):
    """One job run to completion under the course's restarting launcher (see the module docstring).

    case: {"job", "interval", "kills": [{"attempt", "rank", "step", "where"}], "tear": {attempt: name}
    (before that attempt starts, that checkpoint loses its .metadata), "label"}.
    Returns {"attempts": [{"killed": rank or None, "kind", "checkpoints": {name: complete?} after it}],
    "final": [rank] the last attempt's reports, "seconds": [per attempt wall time]}."""
    case = named([dict(case, exercise=exercise)], prefix="job")[0]
    job_folder = os.path.join(folder, case["name"])
    attempts, seconds = [], []
    for attempt in range(max_restarts + 1):
        torn = case.get("tear", {}).get(attempt)
        if torn:
            tear(job_folder, torn)
        faults = [dict(k, kind="kill") for k in case.get("kills", ()) if k["attempt"] == attempt]
        started = time.perf_counter()
        try:
            final = launch_parts(_attempt, train_job, world_size, [dict(case, faults=faults)], folder,
                                 exercise)[0]
        except AssertionError as error:
            torn = [name for name, complete in checkpoints_in(job_folder).items() if not complete]
            hint = (f" ({', '.join(torn)} has no .metadata: its writing was cut short, it is no checkpoint)"
                    if torn else "")
            if "called different collectives" in str(error):
                hint += (" -- every rank calls dcp.save, a collective, at the same steps: a save that some "
                         "ranks skip meets the others' next collective, and never completes")
            raise AssertionError(f"attempt {attempt}: {error}{hint}") from None
        except LaunchError as error:
            seconds.append(time.perf_counter() - started)
            expected = next((f for f in faults if f["rank"] == error.rank), None)
            if expected is None or error.kind != "exited":
                raise AssertionError(f"{exercise} ({case.get('label', case['name'])}), attempt {attempt}: "
                                     + str(error).splitlines()[0]) from None
            attempts.append({"killed": error.rank, "at": [expected["step"], expected["where"]],
                             "checkpoints": checkpoints_in(job_folder)})
            continue
        seconds.append(time.perf_counter() - started)
        unfired = [f for f in faults if f["step"] < case["job"]["steps"]]
        attempts.append({"killed": None, "checkpoints": checkpoints_in(job_folder), "unfired": unfired})
        return {"attempts": attempts, "final": final, "seconds": seconds}
    raise AssertionError(f"{exercise} ({case.get('label', case['name'])}): still failing after "
                         f"{max_restarts} "
                         f"restarts")


# --------------------------------------------------------------------------- 4. hangs

def _heartbeat_case(learner, part):
    """The job with a heartbeat: every rank beats at each place of each step; a collective that times out
    makes the rank ask its heartbeat whom to blame, then release the stuck rank (the file `release`)."""
    label, exercise = part.get("label", part["name"]), part["exercise"]
    heartbeat = guarded(exercise, label, learner, part["folder"])
    faults = [dict(f, folder=part["folder"]) for f in part["faults"]]
    trainer = None
    try:
        trainer = Trainer(dict(part["job"], layout="replicated"), faults=faults,
                          beat=partial(guarded, exercise, label, heartbeat.beat))
        while trainer.step < part["job"]["steps"]:
            trainer.train_step()
        return {"finished": True}
    except Fault as fault:
        return {"stuck": str(fault)}
    except RuntimeError as exc:
        if isinstance(exc, LearnerError) or not (WAITED.search(str(exc)) or VICTIM.search(str(exc))):
            raise
        blamed = guarded(exercise, label, heartbeat.blame)
        with open(os.path.join(part["folder"], "release"), "w"):
            pass
        return {"blamed": blamed, "waited_at": [trainer.step if trainer else 0, "all_reduce"]}


def run_heartbeats(heartbeat_cls, world_size, cases, *, exercise, folder, group_timeout=HANG_TIMEOUT):
    """[case][rank] reports of `_heartbeat_case`: {"blamed": what blame() returned, "waited_at": [step,
    where]} for the ranks that waited, {"stuck": ...} for the stuck rank, {"finished": True} when nothing
    hung.

    One launch per case: a collective that timed out leaves its group unusable (under gloo its peers gave
    up on it; the grader's router, which matches a group's collectives by their order, still holds the
    contributions of the ranks that gave up, and would pair them with the stuck rank's next call)."""
    cases = [dict(case, exercise=exercise) for case in named(cases)]
    return [launch_parts(_heartbeat_case, heartbeat_cls, world_size, [case], folder, exercise,
                         group_timeout=group_timeout)[0] for case in cases]


# --------------------------------------------------------------------------- 5. silent errors

def _guarded_case(learner, part):
    """The replicated job with the learner's two checks: every step, grads_finite_everywhere before the
    gradient all-reduce (False: every rank skips the step); every `every` steps, diverged_ranks (a list:
    the job stops there and says so). After each of the learner's calls the course's loop compares the
    ranks' answers (one all-gather): ranks that disagree would part ways, so the run stops and says so."""
    label, exercise, job = part.get("label", part["name"]), part["exercise"], part["job"]
    trainer = Trainer(dict(job, layout="replicated"), faults=part["faults"])
    verdicts, found = [], None
    while trainer.step < job["steps"]:
        trainer.local_step()
        finite = guarded(exercise, label, learner["finite"], trainer.model)
        if not isinstance(finite, bool):
            raise LearnerError(f"{exercise} ({label})", f"grads_finite_everywhere returned {finite!r}, "
                                                        f"expected True or False")
        decisions = _everyone([float(finite)])
        if len({tuple(d) for d in decisions}) > 1:
            skip = [r for r, d in enumerate(decisions) if not d[0]]
            take = [r for r, d in enumerate(decisions) if d[0]]
            return {**trainer.report(), "verdicts": verdicts, "found": found,
                    "split": f"at step {trainer.step} rank(s) {skip} decided to skip the step and "
                             f"rank(s) {take} "
                             "to take it: the ranks would part ways (those that skip leave the others "
                             "waiting in "
                             f"the gradient all-reduce) -- decide together (one all-reduce of a flag)"}
        if finite:
            trainer.sync_step()
        else:
            trainer.skip_step()
        if trainer.step % part["every"] == 0:
            suspects = guarded(exercise, label, learner["diverged"], trainer.model)
            if not isinstance(suspects, (list, tuple)) or not all(isinstance(r, int) for r in suspects):
                raise LearnerError(f"{exercise} ({label})", f"diverged_ranks returned {suspects!r}, "
                                                            "expected a "
                                                            f"list of ranks")
            suspects = sorted(suspects)
            world = dist.get_world_size()
            answers = _everyone([1.0 if r in suspects else 0.0 for r in range(world)])
            if len({tuple(a) for a in answers}) > 1:
                said = {r: [i for i, v in enumerate(a) if v] for r, a in enumerate(answers)}
                return {**trainer.report(), "verdicts": verdicts, "found": found,
                        "split": f"after step {trainer.step} the ranks' answers differ ({said}): every rank "
                                 f"must reach the same verdict (a check that one rank computes leaves the "
                                 f"others unknowing)"}
            verdicts.append([trainer.step, suspects])
            if suspects:
                found = [trainer.step, suspects]
                break
    return {**trainer.report(), "verdicts": verdicts, "found": found}


def _everyone(values):
    """Every rank's `values` (the course's own all-gather, to compare the ranks' answers)."""
    mine = torch.tensor(values, dtype=torch.float64)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [o.tolist() for o in out]


def run_guarded(learner, world_size, cases, *, exercise, group_timeout=None):
    """[case][rank] reports of `_guarded_case` (trainer.report() plus "verdicts": [[step, suspects]] of every
    check and "found": the first [step, suspects] that named a rank). learner: {"finite", "diverged"}."""
    cases = [dict(case, exercise=exercise) for case in named(cases)]
    return launch_parts(_guarded_case, learner, world_size, cases, None, exercise,
                        group_timeout=group_timeout or TIMEOUTS["test_group"])


# --------------------------------------------------------------------------- 6. stragglers

def _timed_case(learner, part):
    label, exercise = part.get("label", part["name"]), part["exercise"]
    trainer = Trainer(dict(part["job"], layout="replicated"), faults=part["faults"])
    result = guarded(exercise, label, learner, trainer, part["steps"])
    if not isinstance(result, dict):
        raise LearnerError(f"{exercise} ({label})", f"returned {type(result).__name__}, expected a dict")
    return {"result": result, "step": trainer.step}


def run_timed(time_steps, world_size, cases, *, exercise):
    """[case][rank] {"result": what time_steps(trainer, steps) returned, "step": the trainer's step after}."""
    cases = [dict(case, exercise=exercise) for case in named(cases)]
    return launch_parts(_timed_case, time_steps, world_size, cases, None, exercise)
