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

`wire_bytes` turns recorded calls (comm.recorder.CommOp: bytes handed to the call) into bytes on the
network with the ring algorithms of notebook 04, for the demos' loss-against-bytes picture.
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


def powersgd_elements(shapes, matrix_rank):
    """Elements one rank hands to all-reduces per step: {"P": Σ n·r, "Q": Σ m·r, "uncompressed": Σ numel}."""
    counts = {"P": 0, "Q": 0, "uncompressed": 0}
    for shape in shapes:
        if compressible(shape, matrix_rank):
            n, m = matrix_shape(shape)
            r = min(matrix_rank, n, m)
            counts["P"] += n * r
            counts["Q"] += m * r
        else:
            counts["uncompressed"] += math.prod(shape)
    return counts


# bytes a rank sends, as a multiple of the recorded (handed) bytes, in a group of n ranks
_RING = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: n - 1,
    "broadcast": lambda n: (n - 1) / n,  # a pipelined ring, averaged over ranks
    "send": lambda n: 1,
}
_SILENT = {"recv", "recv_any_source", "barrier"}


def wire_bytes(op, world_size=None):
    """Bytes one recorded call puts on the network from this rank, sent as notebook 04's rings would."""
    if op.op in _SILENT:
        return 0.0
    if op.op not in _RING:
        raise ValueError(f"no traffic model for {op.op!r} (known: {', '.join(sorted(_RING))})")
    n = len(op.group) if op.group else world_size
    if n is None:
        raise ValueError(f"the record of {op.op} names no group: pass world_size")
    return _RING[op.op](n) * op.nbytes


def total_wire_bytes(ops_per_rank, world_size=None):
    """Bytes all ranks together put on the network, from each rank's records."""
    return sum(wire_bytes(op, world_size) for ops in ops_per_rank for op in ops)
