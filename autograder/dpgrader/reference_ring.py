"""Reference all-reduces for the benchmark (tests/bench/bench_allreduce.py): grader side, never released.

`ring_all_reduce` is a solution of notebook 04 tuned for speed, so it lives here, not in
course/. What makes it fast with gloo on a CPU (measured in the benchmark):
  * each step posts the irecv before the isend and waits on both, so every rank sends and
    receives at the same time (gloo's p2p is a rendezvous: a message moves only once its
    receive is posted);
  * the receive buffer of the reduce-scatter is allocated once and kept between calls (a
    fresh 16 MiB buffer costs its page faults on every call), the add is in place, and the
    all-gather receives straight into the tensor;
  * with `bidirectional=True` the tensor is split in two halves that travel round the ring
    in opposite directions, so each rank also uses the other direction of each link.
`naive_all_reduce` is notebook 03's (gather to rank 0, add, send back), for comparison.
"""

import torch
import torch.distributed as dist

_BUFFERS = {}


def _scratch(numel, like, slot):
    """A receive buffer of at least numel elements, kept between calls (one per dtype, device, slot)."""
    key = (like.dtype, like.device, slot)
    buffer = _BUFFERS.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = _BUFFERS[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buffer[:numel]


def _ring_phases(streams, group):
    """Run reduce-scatter then all-gather on several independent rings at once.

    streams: list of (chunks, right, left, position, scratch) -- the N chunks of one part of the
    tensor, the group ranks it goes to and comes from, and this rank's position along that ring.
    """
    world = dist.get_world_size(group)
    for phase in ("reduce_scatter", "all_gather"):
        for step in range(world - 1):
            works, adds = [], []
            for chunks, right, left, position, scratch in streams:
                if phase == "reduce_scatter":
                    send_i, recv_i = (position - step - 1) % world, (position - step - 2) % world
                    target = scratch[:chunks[recv_i].numel()]
                    adds.append((chunks[recv_i], target))
                else:
                    send_i, recv_i = (position - step) % world, (position - step - 1) % world
                    target = chunks[recv_i]
                works.append(dist.irecv(target, group=group, group_src=left))
                works.append(dist.isend(chunks[send_i], group=group, group_dst=right))
            for work in works:
                work.wait()
            for chunk, incoming in adds:
                chunk.add_(incoming)


def ring_all_reduce(tensor, group=None, bidirectional=False):
    """In place sum over the group, like dist.all_reduce: reduce-scatter, then all-gather, on a ring."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1:
        return
    flat = tensor.view(-1)
    right, left = (rank + 1) % world, (rank - 1) % world
    parts = flat.tensor_split(2) if bidirectional else (flat,)
    streams = []
    for slot, part in enumerate(parts):
        chunks = part.tensor_split(world)
        scratch = _scratch(chunks[0].numel(), flat, slot)
        if slot == 0:
            streams.append((chunks, right, left, rank, scratch))
        else:  # the same ring walked the other way: positions counted from the other side
            streams.append((chunks, left, right, (world - rank) % world, scratch))
    _ring_phases(streams, group)


def bidirectional_ring_all_reduce(tensor, group=None):
    ring_all_reduce(tensor, group, bidirectional=True)


def naive_all_reduce(tensor, group=None):
    """Notebook 03's: every rank sends to rank 0, which adds and sends the sum back."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank == 0:
        incoming = _scratch(tensor.numel(), tensor, "naive").view_as(tensor)
        for src in range(1, world):
            dist.recv(incoming, group=group, group_src=src)
            tensor += incoming
        for dst in range(1, world):
            dist.send(tensor, group=group, group_dst=dst)
    else:
        dist.send(tensor, group=group, group_dst=0)
        dist.recv(tensor, group=group, group_src=0)
