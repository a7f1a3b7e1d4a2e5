"""Reference all-reduces for the benchmark (tests/bench/bench_allreduce.py): grader side, never released.

`ring_all_reduce` is a solution of notebook 04 tuned for speed, so it lives here, not in
course/. gloo's point-to-point messages are a rendezvous: a message moves only once its
receive is posted, and a blocked `wait()` sleeps, so every step at which a rank must wake
up, post the next receive and only then let its neighbour's data flow costs a scheduler
wake-up (measured here: 0.1 ms to 4 ms on a busy 2-core machine). The tuned ring
  * posts every receive of the reduce-scatter up front, each into its own slice of a
    scratch buffer kept between calls (a fresh buffer costs its page faults every call),
    so a neighbour's message never waits for this rank to be scheduled;
  * waits on a receive only when it needs the data (to add it in place, then send it on),
    and on its sends only at the end of each phase;
  * posts every receive of the all-gather up front too, straight into the tensor's chunks
    (once the reduce-scatter's sends are done: nothing reads those chunks any more).
  * posts each phase's first send before its receives: on 2 ranks (one connection
    carrying both directions) a 2 MiB exchange stalled for 2-5 ms in 30% of tries with the
    receive posted first and in 15% with the send first (measured here, 300 tries each).
It sends exactly the ring's bytes: 2(N-1) messages of one chunk.
`textbook_ring_all_reduce` is the notebook's solution (irecv+isend, wait, add, next step),
and `naive_all_reduce` notebook 03's (gather to rank 0, add, send back), for comparison.
"""

import torch
import torch.distributed as dist

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
    size = chunks[0].numel()
    scratch = _scratch(size * (world - 1), tensor, "ring")

    # reduce-scatter: at step s receive chunk (rank - s - 2), add it, send it on at step s + 1
    targets = [(rank - s - 2) % world for s in range(world - 1)]
    buffers = [scratch[s * size:s * size + chunks[i].numel()] for s, i in enumerate(targets)]
    sends = [dist.isend(chunks[(rank - 1) % world], group=group, group_dst=right)]
    receives = [dist.irecv(b, group=group, group_src=left) for b in buffers]
    for step, i in enumerate(targets):
        receives[step].wait()
        chunks[i].add_(buffers[step])
        if step < world - 2:
            sends.append(dist.isend(chunks[i], group=group, group_dst=right))
    for work in sends:
        work.wait()

    # all-gather: rank holds the finished chunk `rank`; receive the others straight into place
    targets = [(rank - s - 1) % world for s in range(world - 1)]
    sends = [dist.isend(chunks[rank], group=group, group_dst=right)]
    receives = [dist.irecv(chunks[i], group=group, group_src=left) for i in targets]
    for step, i in enumerate(targets):
        receives[step].wait()
        if step < world - 2:
            sends.append(dist.isend(chunks[i], group=group, group_dst=right))
    for work in sends:
        work.wait()


def textbook_ring_all_reduce(tensor, group=None):
    """Notebook 04's solution: each step posts irecv + isend, waits on both, then adds."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = tensor.view(-1).tensor_split(world)
    right, left = (rank + 1) % world, (rank - 1) % world
    incoming = torch.empty_like(chunks[0])
    for step in range(world - 1):
        send_i, recv_i = (rank - step - 1) % world, (rank - step - 2) % world
        buffer = incoming[:chunks[recv_i].numel()]
        works = [dist.irecv(buffer, group=group, group_src=left),
                 dist.isend(chunks[send_i], group=group, group_dst=right)]
        for work in works:
            work.wait()
        chunks[recv_i].add_(buffer)
    for step in range(world - 1):
        send_i, recv_i = (rank - step) % world, (rank - step - 1) % world
        works = [dist.irecv(chunks[recv_i], group=group, group_src=left),
                 dist.isend(chunks[send_i], group=group, group_dst=right)]
        for work in works:
            work.wait()


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
