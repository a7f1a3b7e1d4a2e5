"""How the course splits N things over N ranks: one rule, torch.tensor_split's, written out.

Used by notebooks 01-02 (shards and scatter's pieces: the first n % N get one more), 04 (a ring's
chunks) and the checks and hidden checks of 01-06 that compute expected sizes or chunk bounds.

Why written out: a check must not borrow the learner's way of splitting, and every place that
needs "how big is piece i" or "where does chunk i start" asks here instead of redoing the
arithmetic (where a remainder goes is exactly the off-by-one a ring or a sampler gets wrong).
"""


def chunk_bounds(length, world_size):
    """[(start, stop)] of torch.tensor_split's N chunks: the first length % N get one extra element."""
    bounds, start = [], 0
    for i in range(world_size):
        size = length // world_size + (1 if i < length % world_size else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


def chunk_sizes(length, world_size):
    """The sizes of torch.tensor_split's N chunks of `length` elements: [3, 3, 2, 2] for 10 over 4."""
    return [stop - start for start, stop in chunk_bounds(length, world_size)]


def ceil_div(numerator, denominator):
    """⌈numerator / denominator⌉ for integers, exactly: a padded shard, a ring's largest chunk."""
    return -(-numerator // denominator)
