"""Run a learner's DistributedSampler-like class in a separate process and bring back what it dealt.

Used by notebook 05 (the ShardSampler test cells) and its hidden checks.

Why a separate process: the grader never holds objects the learner's code built (docs/authoring.md,
rule 1). `sampler_shards` builds the sampler of every rank, sets the epoch, iterates it and asks its
len(); it returns plain lists. The test cell compares them with torch's DistributedSampler, built
there with the same arguments.
"""

from dpcourse.runtime.launcher import launch


def sampler_shards(sampler_cls, n, world_size, epoch=0, **options):
    """Inside a process: {"shards": rank r's indices, in order, for every r; "lengths": len() of each
    rank's sampler}, for `sampler_cls(n, num_replicas=world_size, rank=r, **options)` after set_epoch."""
    shards, lengths = [], []
    for rank in range(world_size):
        sampler = sampler_cls(n, num_replicas=world_size, rank=rank, **options)
        sampler.set_epoch(epoch)
        shards.append([int(i) for i in sampler])
        lengths.append(int(len(sampler)))
    return {"shards": shards, "lengths": lengths}


def sampler_cases(sampler_cls, cases):
    """Inside a process: `sampler_shards` of every case (a dict of its keyword arguments), in order."""
    return [sampler_shards(sampler_cls, **case) for case in cases]


def run_sampler_cases(sampler_cls, cases):
    """`sampler_cases` in a one-rank launch: one launch for many cases (a launch costs ~0.5 s graded)."""
    return launch(sampler_cases, 1, sampler_cls, list(cases))[0]


def run_sampler(sampler_cls, n, world_size, epoch=0, **options):
    """`sampler_shards` of one case, in a one-rank launch."""
    return run_sampler_cases(sampler_cls, [dict(n=n, world_size=world_size, epoch=epoch, **options)])[0]


def expect_len_as_dealt(run, n, world_size):
    """len() of every rank's sampler equals the number of indices it yields: a DataLoader sizes its
    epoch with len(), so a rank whose len() lies runs a different number of steps than the others."""
    for rank, (length, shard) in enumerate(zip(run["lengths"], run["shards"], strict=True)):
        if length != len(shard):
            raise AssertionError(f"ShardSampler({n}, num_replicas={world_size}, rank={rank}): len() says "
                                 f"{length} but iterating gives {len(shard)} indices")
