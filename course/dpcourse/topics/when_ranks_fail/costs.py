"""How often to checkpoint: Young's optimum, the time an interval wastes, and failures simulated.

Used by notebook 14 (the lost-work plot, the written answer's arithmetic) and its benchmark.

A job checkpoints after every τ seconds of work, each checkpoint costing δ seconds, and fails at
random with a mean time between failures M (failures of independent GPUs: M = M_gpu / N). A failure
loses the work done since the last checkpoint (τ / 2 on average) and the restart's R seconds. To first
order the fraction of time wasted is

    waste(τ) = δ / τ + (τ / 2 + R) / M,

smallest at τ* = √(2 δ M): Young's interval (J. W. Young, "A first order approximation to the optimum
checkpoint interval", CACM 17(9), 1974). Daly (FGCS 22(3), 2006) derives a higher-order estimate from a
fuller cost model; it stays close to Young's while δ ≪ M (his Fig. 3: M = 24 h, δ = 5 min, R = 10 min
gives τopt = 117 min, where √(2 δ M) = 120 min). `simulate_waste` checks the first-order picture
against failures drawn at random (Poisson), without its approximations.
"""

import math
import random


def young_interval(checkpoint_seconds, mtbf_seconds):
    """Young's optimum interval of work between checkpoints, √(2 δ M), in seconds."""
    return math.sqrt(2.0 * checkpoint_seconds * mtbf_seconds)


def job_mtbf(device_mtbf, devices):
    """The mean time between failures of a job that fails when any one of `devices` independent devices "
      "fails."""
    return device_mtbf / devices


def waste_fraction(interval, checkpoint_seconds, mtbf_seconds, restart_seconds=0.0):
    """First-order fraction of the job's time wasted: δ / τ (checkpoints) + (τ / 2 + R) / M (failures)."""
    return checkpoint_seconds / interval + (interval / 2.0 + restart_seconds) / mtbf_seconds


def simulate_waste(interval, checkpoint_seconds, mtbf_seconds, restart_seconds=0.0, work_seconds=None,
                   trials=200, seed=0):
    """The fraction of wall time not spent on useful work, averaged over `trials` runs with failures drawn
    from an exponential distribution of mean M (failures strike while computing or checkpointing; the
    restart itself is not interrupted). work_seconds: the job's work (default 200 M)."""
    rng = random.Random(seed)
    work_seconds = 200.0 * mtbf_seconds if work_seconds is None else work_seconds
    wasted = 0.0
    for _ in range(trials):
        wall, done, next_failure = 0.0, 0.0, rng.expovariate(1.0 / mtbf_seconds)
        while done < work_seconds:
            segment = min(interval, work_seconds - done)
            cost = segment + (checkpoint_seconds if done + segment < work_seconds else 0.0)
            if wall + cost <= next_failure:
                wall, done = wall + cost, done + segment
            else:
                wall = next_failure + restart_seconds
                next_failure = wall + rng.expovariate(1.0 / mtbf_seconds)
        wasted += (wall - work_seconds) / wall
    return wasted / trials
