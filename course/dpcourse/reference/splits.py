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
"""



def chunk_bounds(length, world_size):
    """[(start, stop)] of torch.tensor_split's N chunks: the first length % N get one extra element."""
    bounds, start = [], 0
    for i in range(world_size):
        size = length // world_size + (1 if i < length % world_size else 0)
        bounds.append((start, start + size))
        start += size
    return bounds
