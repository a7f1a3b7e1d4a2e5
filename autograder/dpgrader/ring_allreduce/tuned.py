"""Reference all-reduces for the benchmark (tests/bench/bench_allreduce.py): grader side, never released.

`ring_all_reduce` is a solution of notebook 04 tuned for speed, so it lives here, not in
course/. It sends exactly the ring's messages (2(N-1) of one chunk per rank) and changes only
when and on which connection they travel. What made it fast here (2 cores, gloo over loopback;
ratios against gloo's `dist.all_reduce` in the same run):
  * every receive of both phases is posted before the first wait -- the reduce-scatter's into
    slices of a scratch buffer kept between calls (a fresh one costs its page faults every
    call), the all-gather's straight into the tensor's chunks -- so a neighbour's message never
    waits for this rank to wake up and post it. Writing into a chunk early is safe: the
    all-gather's copy of chunk i can only arrive after its owner summed it, which needs this
    rank's own contribution to chunk i to have been received;
  * the first send is posted before the receives (on 2 ranks this halved the exchanges that
    stalled for 2-5 ms: 30% -> 15%, 300 tries each);
  * messages from even ranks travel on the world group's connections, messages from odd ranks
    on a twin group's (created once, with its own connections and I/O thread), so each TCP
    connection carries one direction (on a sub-group the ring uses the sub-group alone). On 2
    ranks, where both directions of the ring join the same two processes, this took the ring
    from 0.9-1.05x to 1.0-1.3x gloo's all-reduce at 4-64 MiB; on 4 ranks it changed nothing
    measurable.
`textbook_ring_all_reduce` is the notebook's solution, loaded from solutions/04 (irecv+isend, wait,
add, next step; its two halves `textbook_reduce_scatter` and `textbook_all_gather` are the notebook's
two exercises),
and `naive_all_reduce` notebook 03's (gather to rank 0, add, send back), for comparison.
"""

import torch
import torch.distributed as dist

from dpgrader.solutions import solution_functions

_BUFFERS = {}


def _scratch(numel, like, slot):
    """A buffer of at least numel elements, kept between calls (one per dtype, device and slot)."""
    key = (like.dtype, like.device, slot)
    buffer = _BUFFERS.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = _BUFFERS[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buffer[:numel]


def ring_all_reduce(tensor, group=None):
    """In place sum over the group, like dist.all_reduce: reduce-scatter, then all-gather, on a ring."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1:
        return
    chunks = tensor.view(-1).tensor_split(world)
    right, left = (rank + 1) % world, (rank - 1) % world
    send_group, recv_group = _one_direction_each(group, rank, left)
    size = chunks[0].numel()
    scratch = _scratch(size * (world - 1), tensor, "ring")

    def send(chunk):
        return dist.isend(chunk, group=send_group, group_dst=right)

    def receive(buffer):
        return dist.irecv(buffer, group=recv_group, group_src=left)

    # reduce-scatter: at step s receive chunk (rank - s - 2), add it, send it on; the sum that
    # completes at the last step is this rank's chunk, and sending it starts the all-gather
    summed = [(rank - s - 2) % world for s in range(world - 1)]
    buffers = [scratch[s * size:s * size + chunks[i].numel()] for s, i in enumerate(summed)]
    # all-gather: at step s receive the finished chunk (rank - s - 1) straight into place
    gathered = [(rank - s - 1) % world for s in range(world - 1)]

    sends = [send(chunks[(rank - 1) % world])]
    adding = [receive(b) for b in buffers]
    landing = [receive(chunks[i]) for i in gathered]
    for work, i, buffer in zip(adding, summed, buffers, strict=True):
        work.wait()
        chunks[i].add_(buffer)
        sends.append(send(chunks[i]))
    for step, (work, i) in enumerate(zip(landing, gathered, strict=True)):
        work.wait()
        if step < world - 2:
            sends.append(send(chunks[i]))
    for work in sends:
        work.wait()


_world_twin = None  # the second group over all ranks, made on the first call on the world


def _one_direction_each(group, rank, left):
    """(group to send on, group to receive on): even ranks send on WORLD, odd ranks on its twin.

    The twin has the same ranks and its own connections, so every connection carries messages
    one way only. It is made once, by every rank (new_group is collective over all processes),
    so only calls on the whole world get one: a sub-group's ring runs on the sub-group alone
    (new_group's use_local_synchronization, which would let a sub-group make its own twin,
    deadlocked here once another group had been created).
    """
    global _world_twin
    if group is not None and group != dist.group.WORLD:
        return group, group
    if _world_twin is None:
        _world_twin = dist.new_group(list(range(dist.get_world_size())))
    pair = (dist.group.WORLD, _world_twin)
    return pair[rank % 2], pair[left % 2]


# The notebook's own solutions, read from solutions/04 (so they are the notebook's, never a copy):
# irecv + isend, wait, add, next step; the all-reduce is the two halves one after the other.
textbook_reduce_scatter, textbook_all_gather, textbook_ring_all_reduce = solution_functions(
    "04_ring_allreduce", "ring_reduce_scatter", "ring_all_gather", "ring_all_reduce")


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


# exercise key -> its tuned version here (autograder/exercises.json lists it; a test imports each)
TUNED = {
    "ring_all_reduce": "ring_all_reduce",
}
