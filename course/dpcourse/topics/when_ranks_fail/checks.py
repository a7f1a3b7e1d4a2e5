"""Verdicts of notebook 14's test cells: each raises an AssertionError that says what went wrong.

Used by notebook 14's visible tests and by its hidden checks (autograder/dpgrader/when_ranks_fail).

Expected values are computed here, in the test cell's process, never in the ranks: the job in one
process (`job.simulate`), the global stream of samples (`job.global_stream`), which checkpoints a
restarting job must have written and which one it must resume from (`expected_checkpoints`), and what
each injected fault must be found as. Where a run differs from them, the message names the first
step and rank where it does, and says which piece of state or which rule explains it: a resumed run
that differs is diagnosed piece by piece (step, parameters, AdamW's moments, learning rate, schedule,
samples, each of the three random streams), from what the ranks reported around the checkpoint.
"""

import torch

from dpcourse.checks.core import TOLERANCES, describe, number, shorten
from dpcourse.topics.when_ranks_fail.job import global_stream, shard_bounds, simulate

STREAMS = {
    "torch": "torch's random state (it draws the dropout masks): torch.get_rng_state() / "
             "torch.set_rng_state()",
    "generator": "the trainer's generator (it draws the input noise): trainer.generator.get_state() / "
                 "set_state()",
    "python": "Python's random (it draws the noise strength): random.getstate() / random.setstate()",
}


def _close(a, b, kind="float64 exact"):
    atol, rtol = TOLERANCES[kind]
    return abs(a - b) <= atol + rtol * abs(b)


def _largest(a, b):
    return (a - b).abs().max().item()


def _tensors_close(a, b, kind=torch.float64):
    atol, rtol = TOLERANCES[kind]
    return a.shape == b.shape and bool(torch.allclose(a, b, atol=atol, rtol=rtol))


# --------------------------------------------------------------------------- 1. an exact resume

def expect_matches_the_job(runs, job, what):
    """A run of the course's own loop (per rank reports) is the job as computed in one process: else the
    ranks did not run the job (the run itself, not the checkpoint, is wrong)."""
    world = len(runs)
    reference = simulate(job, world, max(max(r["losses"], default=-1) for r in runs) + 1)
    for rank, report in enumerate(runs):
        for step, loss in sorted(report["losses"].items()):
            expected = reference["losses"][step][rank]
            if not _close(loss, expected):
                raise AssertionError(f"{what}, rank {rank}: the loss of step {step} is {number(loss)}, "
                                     "but the job "
                                     f"computed in one process gives {number(expected)}: this run is not the "
                                     f"course's job")


def expect_exact_resume(run, case, exercise):
    """One case of runs.run_resume at one world size: after load_checkpoint and training on, every rank's
    losses, samples, learning rates, random draws and final parameters equal the uninterrupted run's,
    bit for bit."""
    job, stop, label = case["job"], case["stop"], case.get("label", "")
    full, first, restored, resumed = run["uninterrupted"], run["first"], run["restored"], run["resumed"]
    expect_matches_the_job(full, job, f"{exercise} ({label}), the uninterrupted run")
    for rank in range(len(full)):
        where = f"{exercise} ({label}), rank {rank}"
        problem = _first_difference(full, first, restored, resumed, rank, stop, job)
        if problem:
            raise AssertionError(f"{where}: {problem}")
        if not torch.equal(resumed[rank]["params"], full[rank]["params"]):
            raise AssertionError(f"{where}: the losses agree, but the final parameters differ from the "
                                 f"uninterrupted run's (largest difference "
                                 f"{number(_largest(resumed[rank]['params'], full[rank]['params']))})")


def _first_difference(full, first, restored, resumed, rank, stop, job):
    """Why rank `rank`'s resumed run is not the uninterrupted one, or None when every step is equal."""
    after, whole, saved, back = resumed[rank], full[rank], first[rank], restored[rank]
    if back["step"] != stop:
        return (f"after load_checkpoint the trainer is at step {back['step']}, but the checkpoint was "
                "written "
                f"after {stop} steps: save trainer.step and restore it")
    if not torch.equal(back["params"], saved["params"]):
        return ("after load_checkpoint the model's parameters are not the ones saved (largest difference "
                f"{number((back['params'] - saved['params']).abs().max().item())}): save the model's "
                f"state_dict and load it back")
    for name in ("exp_avg", "exp_avg_sq"):
        if back[name].shape != saved[name].shape or not torch.equal(back[name], saved[name]):
            lo, hi = saved["opt_bounds"]
            return (f"after load_checkpoint this rank's piece of AdamW's {name} (elements {lo} to {hi}) "
                    "is not the "
                    "one saved: save trainer.optimizer.state_dict() (its moments are DTensors: each "
                    "rank writes "
                    f"its own piece) and load it back with trainer.optimizer.load_state_dict()")
    if back["lr"] != saved["lr"]:
        return (f"after load_checkpoint the optimizer's learning rate is {number(back['lr'])}, it was "
                f"{number(saved['lr'])} when saved: the optimizer's state_dict holds it (restore the "
                "optimizer)")
    for step in range(stop, job["steps"]):
        if after["seen"].get(step) != whole["seen"][step]:
            again = [s for s in range(stop) if whole["seen"][s] == after["seen"].get(step)]
            hint = (f" -- those are the samples of step {again[0]}: the sampler started again from "
                    f"{'the start of its epoch' if again else 'an earlier position'}" if again else "")
            return (f"at step {step} the resumed run trained on samples {shorten(after['seen'].get(step))}, "
                    f"the uninterrupted run on {shorten(whole['seen'][step])}{hint}: save the sampler's "
                    f"state_dict (its epoch and position) and load it back")
        if after["lrs"][step] != whole["lrs"][step]:
            return (f"the learning rate of step {step} is {number(after['lrs'][step])} after the resume, "
                    f"{number(whole['lrs'][step])} without a break: the warm-up and cosine schedule "
                    "started over "
                    f"-- save trainer.scheduler.state_dict() and load it back")
        for stream, how in STREAMS.items():
            if after["draws"][step][stream] != whole["draws"][step][stream]:
                others = [r for r in range(len(full)) if r != rank
                          and full[r]["draws"][step][stream] == after["draws"][step][stream]]
                if others:
                    return (f"at step {step} this rank's random stream ({how.split(':')[0]}) is rank "
                            f"{others[0]}'s: "
                            f"the value differs by rank, so it needs a key of its own in the checkpoint "
                            f"(torch.distributed.checkpoint writes a plain value once, as if every rank held "
                            f"the same one, and every rank then loads that copy)")
                return (f"at step {step} the resumed run's random draws differ from the uninterrupted run's: "
                        f"save and restore {how}")
        if after["losses"][step] != whole["losses"][step]:
            return (f"the loss of step {step} is {after['losses'][step]!r} after the resume and "
                    f"{whole['losses'][step]!r} without a break, though parameters, moments, learning rate, "
                    f"samples and random streams were restored: something else the run carries was not")
    return None


# --------------------------------------------------------------------------- 2. another world size

def expect_global_batches(seen_by_step, job, first_step, what, world_sizes):
    """seen_by_step: [step][rank] sample lists from `first_step` on. Each global step's samples, over all
    ranks, are the stream's batch: none repeated, none skipped, each rank global_batch / N of them."""
    stream = global_stream(job, first_step + len(seen_by_step))
    for offset, per_rank in enumerate(seen_by_step):
        step = first_step + offset
        world = world_sizes(step)
        sizes = [len(s) for s in per_rank]
        if any(size != job["global_batch"] // world for size in sizes):
            per = job["global_batch"] // world
            raise AssertionError(f"{what}: at step {step} the {world} ranks trained on {sizes} samples; each "
                                 f"should take {job['global_batch']} / {world} = {per} of the global batch")
        got, expected = sorted(s for share in per_rank for s in share), sorted(stream[step])
        if got != expected:
            epoch_start = step - step % (job["samples"] // job["global_batch"])
            earlier = {s for past in stream[epoch_start:step] for s in past}
            repeated = sorted(set(got) & earlier)
            skipped = sorted(set(expected) - set(got))
            raise AssertionError(
                f"{what}: global step {step} trained on samples {shorten(got)}, but the data order continues "
                f"with {shorten(expected)}: {len(repeated)} sample(s) already trained on this epoch "
                "(repeated), "
                f"{len(skipped)} of this step's skipped -- the sampler's state must say how far the "
                "whole job got "
                f"in the epoch's order (samples consumed by all ranks together), not how far one rank got")


def expect_resharded(run, case, exercise):
    """One case of runs.run_resume from N ranks to M: the data stream continues exactly, each of the M
    ranks holds its piece of the saved AdamW moments, and the run is the job (to float64 rounding)."""
    job, stop, label = case["job"], case["stop"], case.get("label", "")
    first, restored, resumed = run["first"], run["restored"], run["resumed"]
    before, after = len(first), len(resumed)
    what = f"{exercise} ({label}: {before} ranks, then {after} from step {stop})"
    seen = [[first[r]["seen"][s] for r in range(before)] for s in range(stop)]
    seen += [[resumed[r]["seen"].get(s, []) for r in range(after)] for s in range(stop, job["steps"])]
    expect_global_batches(seen, job, 0, what, lambda s: before if s < stop else after)
    numel = first[0]["params"].numel()
    for name in ("exp_avg", "exp_avg_sq"):
        whole = torch.cat([first[r][name] for r in range(before)])
        for rank in range(after):
            lo, hi = shard_bounds(numel, after)[rank]
            if not torch.equal(restored[rank][name], whole[lo:hi]):
                raise AssertionError(
                    f"{what}, rank {rank}: after load_checkpoint its piece of AdamW's {name} is not "
                    f"elements {lo} to "
                    f"{hi} of the {before} ranks' saved moments: the optimizer state was not resharded "
                    "-- load it "
                    f"into the new trainer's own state_dict (its DTensors have the new layout, and "
                    f"torch.distributed.checkpoint reads each new piece from the saved pieces that hold it)")
    reference = simulate(job, 1)
    for rank in range(after):
        if not _tensors_close(resumed[rank]["params"], reference["params"]):
            raise AssertionError(f"{what}, rank {rank}: the final parameters differ from the job "
                                 "trained in one "
                                 f"process on the same global batches (largest difference "
                                 f"{number(_largest(resumed[rank]['params'], reference['params']))})")
    for step in range(stop, job["steps"]):
        mean = sum(resumed[r]["losses"][step] for r in range(after)) / after
        if not _close(mean, reference["losses"][step][0], torch.float64):
            raise AssertionError(f"{what}: the mean loss of step {step} over the ranks is "
                                 f"{number(mean)}, the job in "
                                 f"one process gives {number(reference['losses'][step][0])}")


def expect_sampler(reports, case, exercise):
    """runs.run_sampler's [rank] reports: each rank's batches are its share of the stream's global batches,
    the state is the same on every rank, samplers of other world sizes that load it continue the stream,
    and a global batch that does not split raises a ValueError saying so."""
    job, label, world = case["job"], case.get("label", ""), len(reports)
    what = f"{exercise} ({label}, {world} ranks)"
    draws = case["draws"]
    expect_global_batches([[reports[r]["before"][i] for r in range(world)] for i in range(draws)], job, 0,
                          what, lambda s: world)
    states = [r["state"] for r in reports]
    if any(state != states[0] for state in states):
        raise AssertionError(f"{what}: after {draws} batches the ranks' states differ ({describe(states)}): "
                             f"the state must say how far the whole job got, the same on every rank")
    for world_after in case.get("then", ()):
        shares = reports[0][f"after_{world_after}"]
        batches = [[shares[r][i] for r in range(world_after)] for i in range(case["draws_after"])]
        then = f"{what}, then {world_after} rank(s) that loaded the state {describe(states[0])}"
        expect_global_batches(batches, job, draws, then, lambda s, n=world_after: n)
    if case.get("uneven"):
        batch, ranks = case["uneven"]
        raised = reports[0]["uneven"]
        if not raised.startswith("ValueError") or str(batch) not in raised or str(ranks) not in raised:
            raise AssertionError(f"{what}: a global batch of {batch} over {ranks} ranks raised "
                                 f"{raised!r}; expected a "
                                 f"ValueError that gives both numbers ({batch} and {ranks})")


# --------------------------------------------------------------------------- 3. restarts

def expected_checkpoints(case):
    """[(checkpoints complete after the attempt, the step the attempt resumed from)] per attempt of a case of
    runs.run_restarts: every `interval` steps and at the end, named step-NNNNNN; a torn one does not count."""
    job, interval = case["job"], case["interval"]
    complete, out = set(), []
    for attempt in range(len(case.get("kills", ())) + 1):
        torn = case.get("tear", {}).get(attempt)
        if torn:
            complete.discard(int(torn.split("-")[1]))
        start = max(complete, default=0)
        kill = next((k for k in case.get("kills", ()) if k["attempt"] == attempt), None)
        last = kill["step"] if kill else job["steps"]
        complete |= {k for k in range(start + 1, last + 1) if k % interval == 0 or k == job["steps"]}
        out.append((sorted(complete), start))
    return out


def expect_restarts(result, case, reference, exercise):
    """A case of runs.run_restarts: each attempt died where the case killed it, the job wrote its checkpoints
    on schedule, the last attempt resumed from the latest complete one, and the job ended exactly where the
    uninterrupted run (`reference`, [rank] reports) ends."""
    label, job = case.get("label", ""), case["job"]
    what = f"{exercise} ({label})"
    expected = expected_checkpoints(case)
    for attempt, (info, (complete, _)) in enumerate(zip(result["attempts"], expected, strict=False)):
        names = [f"step-{k:06d}" for k in complete]
        missing = [n for n in names if not info["checkpoints"].get(n)]
        if missing:
            how = f"killed at step {info['at'][0]}" if info.get("killed") is not None else "done"
            held = sorted(n for n, ok in info["checkpoints"].items() if ok) or "no complete checkpoint"
            raise AssertionError(
                f"{what}: after attempt {attempt} ({how}) the checkpoint folder holds {held}; expected "
                f"{names} complete (one every {case['interval']} steps and one at the end, each in "
                f"checkpoint_dir/step-NNNNNN)")
    kills = len(case.get("kills", ()))
    if len(result["attempts"]) != kills + 1 or result["attempts"][-1]["killed"] is not None:
        raise AssertionError(f"{what}: the job took {len(result['attempts'])} attempt(s); {kills} "
                             "kill(s) make "
                             f"{kills + 1}")
    start = expected[-1][1]
    for rank, final in enumerate(result["final"]):
        got = final.get("resumed_from")
        if got != start:
            if start == 0:
                why = "no checkpoint was complete, so the job must start from step 0"
            elif got == 0:
                why = "it started again from scratch, recomputing every step"
            elif got is not None and got < start:
                why = (f"it took an older checkpoint (compare steps as numbers: step-{got:06d} < "
                       f"step-{start:06d}), recomputing {start - got} step(s) for nothing")
            else:
                why = "a checkpoint without .metadata was cut short while being written, and is no checkpoint"
            raise AssertionError(f"{what}, rank {rank}: the last attempt resumed from step {got}; the "
                                 "latest complete "
                                 f"checkpoint was step {start}: {why}")
        for step in range(start, job["steps"]):
            if final["losses"].get(step) != reference[rank]["losses"][step]:
                raise AssertionError(f"{what}, rank {rank}: after the restart, the loss of step {step} is "
                                     f"{final['losses'].get(step)!r}, the uninterrupted run's "
                                     f"{reference[rank]['losses'][step]!r}: the checkpoint it resumed "
                                     "from did not "
                                     f"restore everything (exercise 1)")
        if not torch.equal(final["params"], reference[rank]["params"]):
            raise AssertionError(f"{what}, rank {rank}: the job ended with other parameters than the "
                                 "uninterrupted "
                                 f"run")


def lost_steps(case):
    """Per kill of a restart case, the steps of work it cost: those done since the latest complete "
      "checkpoint."""
    expected = expected_checkpoints(case)
    kills = sorted(case.get("kills", ()), key=lambda k: k["attempt"])
    return [kill["step"] - expected[kill["attempt"]][1] for kill in kills]


# --------------------------------------------------------------------------- 4. hangs

def expect_blamed(reports, case, exercise):
    """A case of runs.run_heartbeats: every rank that waited blamed the stuck rank, at its step and place
    ("before its first heartbeat" when it hung before beating at all)."""
    fault = case["faults"][0]
    stuck, label = fault["rank"], case.get("label", "")
    step, where = (None, "before its first heartbeat") if fault["where"] == "start" else (fault["step"],
                                                                                          fault["where"])
    place = "before its first heartbeat" if step is None else f"at step {step}, {where}"
    truth = f"rank {stuck} was stuck {place}"
    for rank, report in enumerate(reports):
        if rank == stuck:
            continue
        if "blamed" not in report:
            raise AssertionError(f"{exercise} ({label}), rank {rank}: it did not wait for anyone "
                                 f"({describe(report)}); "
                                 f"{truth}")
        blamed = report["blamed"]
        if not isinstance(blamed, dict) or set(blamed) < {"rank", "step", "where"}:
            raise AssertionError(f"{exercise} ({label}), rank {rank}: blame() returned {blamed!r}; expected "
                                 f"{{'rank', 'step', 'where'}}")
        if (blamed["rank"], blamed["step"], blamed["where"]) != (stuck, step, where):
            waited = report["waited_at"][0]
            if blamed["rank"] != stuck and blamed.get("where") in ("all_reduce", "optimizer"):
                # which of the waiting ranks it names depends on timing: the message does not say
                raise AssertionError(
                    f"{exercise} ({label}), rank {rank}: blamed a rank that was waiting in the "
                    "all-reduce of step "
                    f"{waited} like the others, but {truth} -- compare how far each rank got (its step, "
                    "then its "
                    f"place in PHASES), not how recently or how often it beat")
            hint = ""
            if blamed["rank"] != stuck and blamed["rank"] == rank:
                hint = " -- a rank that waited is a victim, not the culprit"
            elif blamed["rank"] != stuck and stuck == _silent(case, reports):
                hint = " -- a rank that never wrote a heartbeat is the furthest behind of all"
            elif blamed["rank"] == stuck:
                hint = " -- the place is the stuck rank's own last heartbeat, not where the others waited"
            raise AssertionError(
                f"{exercise} ({label}), rank {rank}: blamed rank {blamed['rank']} (step {blamed['step']}, "
                f"{blamed['where']}), but {truth}; the others waited in the all-reduce of step "
                f"{waited}{hint}")


def _silent(case, reports):
    fault = case["faults"][0]
    return fault["rank"] if fault["where"] == "start" else None


# --------------------------------------------------------------------------- 5. silent errors

def expect_found(reports, case, exercise):
    """A case of runs.run_guarded: every rank skipped exactly the steps with a non-finite gradient, and
    found the flipped rank at the first check after the flip; up to there, the run is the job with those
    steps skipped."""
    job, label, every = case["job"], case.get("label", ""), case["every"]
    what = f"{exercise} ({label})"
    nan_steps = sorted(f["step"] for f in case["faults"] if f["kind"] == "nan")
    flips = [f for f in case["faults"] if f["kind"] == "flip"]
    for rank, report in enumerate(reports):
        if report.get("split"):
            raise AssertionError(f"{what}: {report['split']}")
        if report["skipped"] != nan_steps:
            raise AssertionError(f"{what}, rank {rank}: skipped steps {report['skipped']}; a non-finite "
                                 "gradient "
                                 f"on one rank at step(s) {nan_steps} must make every rank skip "
                                 f"{'them' if len(nan_steps) > 1 else 'it'}")
        if not torch.isfinite(report["params"]).all():
            raise AssertionError(f"{what}, rank {rank}: the parameters hold NaN or infinity: a step with a "
                                 "non-finite gradient was taken (the averaged gradient carries one "
                                 "rank's NaN "
                                 f"to every rank)")
    if flips:
        flip = flips[0]
        found_at = next(c for c in range(flip["step"] + 1, job["steps"] + every + 1) if c % every == 0)
        expected = [found_at, [flip["rank"]]] if len(reports) > 2 else [found_at, list(range(len(reports)))]
        for rank, report in enumerate(reports):
            if report["found"] != expected:
                got = report["found"]
                hint = ""
                if got is None:
                    hint = (" -- it was never found: the fingerprint must change with any bit of any "
                            "parameter "
                            "(a float sum absorbs a change in the last bits: compare the bits)")
                elif got[1] and flip["rank"] not in got[1]:
                    hint = " -- the odd one out is the rank whose fingerprint differs from most others'"
                raise AssertionError(
                    f"{what}, rank {rank}: found {got!r} ([after step, suspects]); a bit of rank "
                    f"{flip['rank']}'s "
                    f"parameters flipped after step {flip['step']}, so the check after step {found_at} "
                    "(every "
                    f"{every}) must name {expected[1]}{hint}")
        for rank, report in enumerate(reports):
            for step, suspects in report["verdicts"]:
                if step <= flip["step"] and suspects:
                    raise AssertionError(f"{what}, rank {rank}: the check after step {step} named "
                                         f"{suspects}, "
                                         f"before anything went wrong")
    steps_run = reports[0]["step"]
    reference = simulate(dict(job, layout="replicated"), len(reports), steps_run, skip=nan_steps)
    clean = [r for r in range(len(reports)) if not flips or r != flips[0]["rank"]]
    for rank in clean:
        for step in range(min(steps_run, flips[0]["step"] + 1) if flips else steps_run):
            if not _close(reports[rank]["losses"][step], reference["losses"][step][rank], torch.float64):
                raise AssertionError(f"{what}, rank {rank}: the loss of step {step} is "
                                     f"{number(reports[rank]['losses'][step])}, the job with step(s) "
                                     f"{nan_steps} "
                                     f"skipped gives {number(reference['losses'][step][rank])}")


# --------------------------------------------------------------------------- 6. stragglers

def expect_straggler(reports, case, exercise):
    """A case of runs.run_timed: every rank returned the same report; the slow rank is named; each rank's
    compute time is its own work (the slow rank's includes its sleep, the others' does not); step_time is
    the slowest rank's compute per step and idle 1 - mean / max."""
    label, world = case.get("label", ""), len(reports)
    what = f"{exercise} ({label})"
    slow = case["faults"][0]["rank"]
    seconds = case["faults"][0]["seconds"]
    results = [r["result"] for r in reports]
    keys = {"compute", "slowest", "step_time", "idle"}
    for rank, result in enumerate(results):
        if set(result) < keys:
            raise AssertionError(f"{what}, rank {rank}: returned the keys {sorted(result)}; expected "
                                 f"{sorted(keys)}")
    compute = [torch.as_tensor(r["compute"], dtype=torch.float64) for r in results]
    for rank in range(1, world):
        if compute[rank].shape != compute[0].shape or not torch.equal(compute[rank], compute[0]) \
                or results[rank]["slowest"] != results[0]["slowest"]:
            raise AssertionError(f"{what}: rank {rank}'s report differs from rank 0's: every rank must "
                                 "see every "
                                 f"rank's times (gather them), and reach the same verdict")
    times = compute[0]
    if tuple(times.shape) != (world, case["steps"]):
        raise AssertionError(f"{what}: compute has shape {tuple(times.shape)}; expected ({world}, "
                             f"{case['steps']}) "
                             f"(a row per rank, a column per step)")
    medians = times.median(dim=1).values
    fast = [r for r in range(world) if r != slow]
    if float(times[slow].min()) < seconds:
        raise AssertionError(f"{what}: rank {slow} slept {seconds} s in every step, but its measured "
                             "compute is less "
                             "than that in some step: time the rank's own part of the step "
                             "(trainer.local_step())")
    too_slow = [r for r in fast if float(medians[r]) >= seconds]
    if too_slow:
        # the message names no measured time: they differ from run to run
        raise AssertionError(f"{what}: rank(s) {too_slow} measured a median of at least {seconds} s of "
                             "compute per "
                             f"step, though their own work takes milliseconds and only rank {slow} "
                             f"slept {seconds} s: "
                             "the timed region includes waiting for the slowest rank (a barrier or the "
                             "gradient "
                             f"all-reduce) -- stop the clock when local_step() returns")
    if results[0]["slowest"] != slow:
        fastest = int(medians.argmin())
        raise AssertionError(f"{what}: named rank {results[0]['slowest']} as the slowest; rank {slow} "
                             "is (its median "
                             f"compute holds its {seconds} s sleep, the others' a few milliseconds)"
                             + (" -- that is the fastest rank" if results[0]["slowest"] == fastest else ""))
    slowest = times.max(dim=0).values
    step_time = torch.as_tensor(results[0]["step_time"], dtype=torch.float64)
    if step_time.shape != slowest.shape or not torch.allclose(step_time, slowest, rtol=1e-12, atol=0.0):
        mean = step_time.shape == slowest.shape and torch.allclose(step_time, times.mean(dim=0), rtol=1e-9)
        raise AssertionError(f"{what}: step_time is not each step's largest compute time over the ranks"
                             + (" (it is their mean)" if mean else "") + ": a synchronous step waits for its "
                             "slowest rank")
    idle = torch.as_tensor(results[0]["idle"], dtype=torch.float64)
    expected = 1 - times.mean(dim=0) / slowest
    if idle.shape != expected.shape or not torch.allclose(idle, expected, rtol=1e-9, atol=1e-12):
        fastest_wait = 1 - times.min(dim=0).values / slowest
        against_min = (idle.shape == expected.shape
                       and torch.allclose(idle, fastest_wait, rtol=1e-9, atol=1e-12))
        raise AssertionError(f"{what}: idle is not 1 - mean / max of the ranks' compute times per step "
                             "(the fraction "
                             f"of the ranks' time spent waiting)"
                             + (" -- it is 1 - min / max, the fastest rank's wait alone" if against_min
                                else ""))
