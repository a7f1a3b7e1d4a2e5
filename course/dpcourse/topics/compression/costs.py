"""Bytes: what each method of notebook 11 hands to the network, by formula and from recorded calls.

Per step and per rank, for a gradient of n elements of e bytes on N ranks:

    full all-reduce (ring, notebook 04)   2(N-1)/N · n·e                sent by each rank
    top-k, all-gathered                   k·(e + 4) handed to the all-gathers (k values, k int32 indices);
                                          a ring all-gather forwards every rank's piece: (N-1)·k·(e + 4) sent
    PowerSGD, rank r                      per compressed n×m matrix (n + m)·r elements instead of n·m,
                                          all-reduced: 2(N-1)/N · (those elements)·e sent
    local SGD, every H steps              the full all-reduce of the parameters, once per H steps
    parameter server                      per update: the server sends the parameters, a worker the gradient

Why the all-gather for top-k: the sum of N sparse vectors is not sparse (k nonzeros each, up to N·k
together), so a ring all-reduce cannot stay compressed along the ring; each rank's k (value, index)
pairs are gathered instead, and every rank adds the N sparse vectors itself. Its cost grows with N:
top-k sends fewer bytes than the full all-reduce only while (N-1)·k·(e + 4) < 2(N-1)/N · n·e, i.e.
k/n < 2e / (N·(e + 4)), which is 1/N in float32: an eighth of the gradient on 8 ranks, 1/64 on 64.

Bytes on the network from recorded calls (the demos' loss-against-bytes picture) come from
dpcourse.comm.volume, which counts every call as notebook 04's rings send it.
"""

import math

INDEX_BYTES = 4  # an int32 index: enough for tensors below 2**31 elements


def topk_handed_bytes(k, element_size):
    """Bytes one rank hands to the all-gathers of one top-k all-reduce: k values and k int32 indices."""
    return k * (element_size + INDEX_BYTES)


def matrix_shape(shape):
    """(n, m): a gradient of shape (n, d1, d2, ...) viewed as an n × (d1·d2·...) matrix."""
    return shape[0], math.prod(shape[1:])


def compressible(shape, matrix_rank):
    """PowerSGD's rule here: a tensor of >= 2 dimensions, viewed as n × m, is compressed at rank
    r = min(matrix_rank, n, m) when its factors are smaller than it: (n + m)·r < n·m (torch's
    `_should_compress` with min_compression_rate=1). Vectors (biases) are never compressed."""
    if len(shape) < 2:
        return False
    n, m = matrix_shape(shape)
    r = min(matrix_rank, n, m)
    return (n + m) * r < n * m


def powersgd_elements(shapes, matrix_rank, every_matrix=False):
    """Elements one rank hands to all-reduces per step: {"P": Σ n·r, "Q": Σ m·r, "uncompressed": Σ numel}.

    every_matrix=True: without the (n + m)·r < n·m rule, every tensor of >= 2 dimensions compressed
    (what a hook that forgets the rule sends; notebook 11's check names that mistake).
    """
    counts = {"P": 0, "Q": 0, "uncompressed": 0}
    for shape in shapes:
        if len(shape) >= 2 if every_matrix else compressible(shape, matrix_rank):
            n, m = matrix_shape(shape)
            r = min(matrix_rank, n, m)
            counts["P"] += n * r
            counts["Q"] += m * r
        else:
            counts["uncompressed"] += math.prod(shape)
    return counts
