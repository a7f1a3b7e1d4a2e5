"""Hidden checks of 14_when_ranks_fail. Each raises a short AssertionError saying what is wrong.

Every learner function runs inside launched ranks (dpcourse.topics.when_ranks_fail.runs) with faults
injected there by the course's trainer; what comes back is plain reports, and the verdicts
(dpcourse.topics.when_ranks_fail.checks) are computed here, against the job computed in one process,
the stream of global batches, and the checkpoints a restarting job must have left. With the visible
tests the cases cover 1 to 4 ranks, checkpoints after the first and the last step, a resume on 1 rank
at an epoch's end, an epoch that leaves samples over, a kill at step 0 and at the last step,
two failures in one run (three here), a checkpoint whose writing was cut short, a rank stuck before its
first heartbeat, the lowest bit of one parameter, rank 0 as the culprit, and several NaN steps.
Several cases share a launch where they can (a launch costs ~0.3-0.5 s, a case milliseconds); a kill
or a hang costs a launch of its own.
"""

import tempfile

from dpcourse.topics.when_ranks_fail.checks import (
    expect_blamed,
    expect_exact_resume,
    expect_found,
    expect_resharded,
    expect_restarts,
    expect_sampler,
    expect_straggler,
)
from dpcourse.topics.when_ranks_fail.job import make_job
from dpcourse.topics.when_ranks_fail.runs import (
    run_guarded,
    run_heartbeats,
    run_restarts,
    run_resume,
    run_sampler,
    run_timed,
    run_uninterrupted,
)

# What each exercise's expected values come from (autograder/exercises.json lists them).
REFERENCES = {
    "exact_checkpoint": "the same job trained without a break (the course's own loop, no learner code), "
                        "compared bit for bit; that run against the job computed in one process "
                        "(job.simulate: "
                        "every rank's batch and random streams in turn, float64)",
    "elastic_sampler": "the stream of global batches written out (job.global_stream: each epoch's seeded "
                       "order in batches); the saved moments resharded with torch.chunk's split; the "
                       "job in one "
                       "process on the same global batches",
    "restart_from_checkpoint": "the same job trained without a break by the course's own loop, bit for bit; "
                               "the checkpoints and the resume step a restarting job must have, worked "
                               "out from "
                               "the kills and the interval (checks.expected_checkpoints)",
    "heartbeat": "the rank, step and place where the course's trainer was told to stop",
    "cross_rank_checks": "the rank whose bit the course's trainer flipped and the steps whose gradient "
                         "it made "
                         "NaN; the job in one process with those steps skipped",
    "straggler_report": "the rank the course's trainer made sleep, and its sleep as a lower bound; step_time "
                        "and idle recomputed from the reported times",
}


def _folder():
    return tempfile.TemporaryDirectory()


# --------------------------------------------------------------------------- 1. exact resume

def check_exact_checkpoint(save_checkpoint, load_checkpoint):
    """3 ranks: a checkpoint after step 1; another batch size (global batches of 6: another sampler
    position, eight steps per epoch) checkpointed after its last step (nothing left to train). One pair of
    launches (the visible tests run 2 and 4 ranks)."""
    learner = {"save": save_checkpoint, "load": load_checkpoint}
    exercise = "save_checkpoint / load_checkpoint"
    cases = [dict(job=make_job(steps=6), stop=1, uninterrupted=True, label="3 ranks, a checkpoint after "
                                                                           "step 1"),
             dict(job=make_job(steps=9, global_batch=6, seed=3), stop=9, uninterrupted=True,
                  label="3 ranks, global batches of 6, a checkpoint after the last step")]
    with _folder() as folder:
        runs = run_resume(learner, 3, cases, exercise=exercise, folder=folder)
    for case, run in zip(cases, runs, strict=True):
        expect_exact_resume(run, case, exercise)


# --------------------------------------------------------------------------- 2. another world size

def check_elastic_sampler(ElasticSampler, save_checkpoint, load_checkpoint):
    """The sampler alone on 4 ranks over 50 samples (2 left over each epoch), then on 3, 2 and 1; two whole
    jobs resumed from 4 ranks on 1: a checkpoint at the end of the first epoch, and 50 samples in global
    batches of 8 (the visible test resumes 4 ranks on 3)."""
    sampler_case = dict(job=make_job(samples=50), draws=6, then=[3, 2, 1], draws_after=4, uneven=(10, 4),
                        label="50 samples, global batches of 12")
    expect_sampler(run_sampler(ElasticSampler, 4, [sampler_case], exercise="ElasticSampler")[0], sampler_case,
                   "ElasticSampler")
    learner = {"save": save_checkpoint, "load": load_checkpoint, "sampler": ElasticSampler}
    quiet = dict(dropout=0.0, noise=0.0)
    cases = [dict(job=make_job(steps=7, **quiet), stop=4, label="a checkpoint at the end of the first epoch"),
             dict(job=make_job(steps=9, samples=50, global_batch=8, seed=2, **quiet), stop=5,
                  label="50 samples in global batches of 8, a checkpoint after step 5")]
    with _folder() as folder:
        runs = run_resume(learner, 4, cases, resume_on=1, exercise="ElasticSampler", folder=folder)
    for case, run in zip(cases, runs, strict=True):
        expect_resharded(run, case, "ElasticSampler")


# --------------------------------------------------------------------------- 3. restarts

def check_restart_from_checkpoint(train_job):
    """3 ranks, 12 steps, a checkpoint every 5 (step-000005, step-000010, step-000012): killed at step 0 (no
    checkpoint yet); killed at step 11 (resume from 10, past 9: steps compare as numbers); killed again at the
    last step, 11, after which step-000010 loses its .metadata (its writing cut short): resume from 5."""
    job = make_job(steps=12)
    case = dict(job=job, interval=5, label="3 ranks, 12 steps, a checkpoint every 5, killed three times",
                kills=[dict(attempt=0, rank=2, step=0, where="forward"),
                       dict(attempt=1, rank=0, step=11, where="backward"),
                       dict(attempt=2, rank=1, step=11, where="all_reduce")],
                tear={3: "step-000010"})
    reference = run_uninterrupted(job, 3)
    with _folder() as folder:
        result = run_restarts(train_job, 3, case, exercise="train_job", folder=folder)
    expect_restarts(result, case, reference, "train_job")


# --------------------------------------------------------------------------- 4. hangs

def check_heartbeat(Heartbeat):
    """4 ranks, rank 3 stuck before it ever beats."""
    case = dict(job=make_job(steps=3), faults=[dict(rank=3, step=0, where="start", kind="hang")],
                label="4 ranks, rank 3 stuck before its first heartbeat")
    with _folder() as folder:
        expect_blamed(run_heartbeats(Heartbeat, 4, [case], exercise="Heartbeat", folder=folder)[0], case,
                      "Heartbeat")


# --------------------------------------------------------------------------- 5. silent errors

def check_cross_rank_checks(diverged_ranks, grads_finite_everywhere):
    """4 ranks, a check every 3 steps: NaNs in rank 3's gradient at steps 1 and 5, the lowest bit of one of
    rank 0's parameters flipped after step 6 (a float sum would not see it)."""
    case = dict(job=make_job(steps=12), every=3, label="4 ranks, the lowest bit of one of rank 0's "
                                                       "parameters",
                faults=[dict(rank=3, step=1, where="backward_done", kind="nan", index=2),
                        dict(rank=3, step=5, where="backward_done", kind="nan", index=7),
                        dict(rank=0, step=6, where="end", kind="flip", index=30, bit=0)])
    exercise = "diverged_ranks / grads_finite_everywhere"
    reports = run_guarded({"finite": grads_finite_everywhere, "diverged": diverged_ranks}, 4, [case],
                          exercise=exercise)[0]
    expect_found(reports, case, exercise)


# --------------------------------------------------------------------------- 6. stragglers

def check_straggler_report(time_steps):
    """2 ranks, rank 1 slow in its data loading, 4 steps."""
    case = dict(job=make_job(steps=8), steps=4, label="2 ranks, rank 1 slow",
                faults=[dict(rank=1, step=s, where="data", kind="slow", seconds=0.12) for s in range(4)])
    expect_straggler(run_timed(time_steps, 2, [case], exercise="time_steps")[0], case, "time_steps")


__all__ = ["check_exact_checkpoint", "check_elastic_sampler", "check_restart_from_checkpoint",
           "check_heartbeat", "check_cross_rank_checks", "check_straggler_report"]
