"""When ranks fail (notebook 14): resume exactly, restart after a kill, name a hang, find silent errors
and stragglers.

  job       the training job every exercise runs: a float64 MLP with dropout and noisy inputs, a
            sharded AdamW (ZeRO-1: DTensor moments), a warm-up + cosine schedule, a sampler, every
            random stream per rank, and the faults a test injects; `simulate`, the same job in one
            process (the reference)
  runs      run a learner's checkpointing, restarts, heartbeats, cross-rank checks and timers on ranks
            (each rank is sent only its own part of a case), and the course's restarting launcher
  checks    verdicts for test cells: losses bit for bit, the data stream, who was blamed, what was found
  costs     checkpoint interval arithmetic: Young's optimum, the waste of an interval, failures simulated
  pictures  the lost work against the checkpoint interval, per-rank step times
  worker    the torchrun program: the same job and faults, run by `torchrun --max-restarts`
"""
