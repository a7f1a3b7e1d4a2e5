"""Planted bugs for 04_ring_allreduce: each must lose the listed cells with a message saying why.

ring_all_reduce may call the learner's ring_reduce_scatter and ring_all_gather, so a variant
that breaks those pairs them with an all-reduce bug that does not call them (a collective, a
bypass, a whole-tensor ring, a root), and the variant whose all-reduce uses them ("forgets the
all-gather phase") breaks them only where the all-reduce fails anyway. Six variants, six bugs
per exercise.
"""

# ---- ring_reduce_scatter ---------------------------------------------------------------------

RS_OFF_BY_ONE = """
def ring_reduce_scatter(tensor, group=None):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = tensor.view(-1).tensor_split(world)
    right, left = (rank + 1) % world, (rank - 1) % world
    incoming = torch.empty_like(chunks[0])
    for step in range(world - 1):
        send_i, recv_i = (rank - step) % world, (rank - step - 1) % world
        buffer = incoming[:chunks[recv_i].numel()]
        works = [dist.irecv(buffer, group=group, group_src=left),
                 dist.isend(chunks[send_i], group=group, group_dst=right)]
        for work in works:
            work.wait()
        chunks[recv_i].add_(buffer)
"""

RS_NEEDS_DIVISIBLE_LENGTH = """
def ring_reduce_scatter(tensor, group=None):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    flat = tensor.view(-1)
    n = flat.numel() // world
    chunks = [flat[i * n:(i + 1) * n] for i in range(world)]
    right, left = (rank + 1) % world, (rank - 1) % world
    incoming = torch.empty_like(chunks[0])
    for step in range(world - 1):
        send_i, recv_i = (rank - step - 1) % world, (rank - step - 2) % world
        works = [dist.irecv(incoming, group=group, group_src=left),
                 dist.isend(chunks[send_i], group=group, group_dst=right)]
        for work in works:
            work.wait()
        chunks[recv_i].add_(incoming)
"""

RS_DEADLOCK_RECV_FIRST = """
def ring_reduce_scatter(tensor, group=None):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = tensor.view(-1).tensor_split(world)
    right, left = (rank + 1) % world, (rank - 1) % world
    incoming = torch.empty_like(chunks[0])
    for step in range(world - 1):
        send_i, recv_i = (rank - step - 1) % world, (rank - step - 2) % world
        buffer = incoming[:chunks[recv_i].numel()]
        dist.recv(buffer, group=group, group_src=left)
        dist.send(chunks[send_i], group=group, group_dst=right)
        chunks[recv_i].add_(buffer)
"""

RS_WRONG_PEER = """
def ring_reduce_scatter(tensor, group=None):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = tensor.view(-1).tensor_split(world)
    right, left = (rank + 1) % world, (rank - 1) % world
    incoming = torch.empty_like(chunks[0])
    for step in range(world - 1):
        send_i, recv_i = (rank - step - 1) % world, (rank - step - 2) % world
        buffer = incoming[:chunks[recv_i].numel()]
        works = [dist.irecv(buffer, group=group, group_src=right),
                 dist.isend(chunks[send_i], group=group, group_dst=left)]
        for work in works:
            work.wait()
        chunks[recv_i].add_(buffer)
"""

RS_IGNORES_GROUP = """
def ring_reduce_scatter(tensor, group=None):
    world, rank = dist.get_world_size(), dist.get_rank()
    chunks = tensor.view(-1).tensor_split(world)
    right, left = (rank + 1) % world, (rank - 1) % world
    incoming = torch.empty_like(chunks[0])
    for step in range(world - 1):
        send_i, recv_i = (rank - step - 1) % world, (rank - step - 2) % world
        buffer = incoming[:chunks[recv_i].numel()]
        works = [dist.irecv(buffer, left), dist.isend(chunks[send_i], right)]
        for work in works:
            work.wait()
        chunks[recv_i].add_(buffer)
"""

RS_NOT_IN_PLACE = """
def ring_reduce_scatter(tensor, group=None):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    tensor = tensor.clone()                     # works on a copy: the caller's tensor never changes
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
    return tensor
"""

# ---- ring_all_gather -------------------------------------------------------------------------

AG_TEMPLATE = """
def ring_all_gather(tensor, group=None):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = tensor.view(-1).tensor_split(world)
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range({steps}):
        send_i, recv_i = {indices}
        works = [dist.irecv(chunks[recv_i], group=group, group_src=left),
                 dist.isend(chunks[send_i], group=group, group_dst=right)]
        for work in works:
            work.wait()
"""
AG_OFF_BY_ONE = AG_TEMPLATE.format(steps="world - 1",
                                   indices="(rank - step - 1) % world, (rank - step - 2) % world")
AG_STOPS_ONE_STEP_EARLY = AG_TEMPLATE.format(steps="world - 2",
                                             indices="(rank - step) % world, (rank - step - 1) % world")

AG_ADDS_INSTEAD_OF_COPIES = """
def ring_all_gather(tensor, group=None):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = tensor.view(-1).tensor_split(world)
    right, left = (rank + 1) % world, (rank - 1) % world
    incoming = torch.empty_like(chunks[0])
    for step in range(world - 1):
        send_i, recv_i = (rank - step) % world, (rank - step - 1) % world
        buffer = incoming[:chunks[recv_i].numel()]
        works = [dist.irecv(buffer, group=group, group_src=left),
                 dist.isend(chunks[send_i], group=group, group_dst=right)]
        for work in works:
            work.wait()
        chunks[recv_i].add_(buffer)
"""

AG_BROADCASTS_EACH_CHUNK = """
def ring_all_gather(tensor, group=None):
    world = dist.get_world_size(group)
    for owner, chunk in enumerate(tensor.view(-1).tensor_split(world)):
        dist.broadcast(chunk.clone(), group=group, group_src=owner)
"""

AG_IGNORES_GROUP = """
def ring_all_gather(tensor, group=None):
    world, rank = dist.get_world_size(), dist.get_rank()
    chunks = tensor.view(-1).tensor_split(world)
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):
        send_i, recv_i = (rank - step) % world, (rank - step - 1) % world
        works = [dist.irecv(chunks[recv_i], left), dist.isend(chunks[send_i], right)]
        for work in works:
            work.wait()
"""

AG_SENDS_THE_WHOLE_TENSOR = """
def ring_all_gather(tensor, group=None):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    flat = tensor.view(-1)
    chunks = flat.tensor_split(world)
    right, left = (rank + 1) % world, (rank - 1) % world
    incoming = torch.empty_like(flat)
    for step in range(world - 1):
        recv_i = (rank - step - 1) % world
        works = [dist.irecv(incoming, group=group, group_src=left),
                 dist.isend(flat.clone(), group=group, group_dst=right)]
        for work in works:
            work.wait()
        chunks[recv_i].copy_(incoming.tensor_split(world)[recv_i])
"""

# ---- ring_all_reduce -------------------------------------------------------------------------

AR_USES_ALL_REDUCE = """
def ring_all_reduce(tensor, group=None):
    dist.all_reduce(tensor, group=group)
"""

AR_PROCESS_GROUP_BYPASS = """
def ring_all_reduce(tensor, group=None):
    (group or dist.group.WORLD).allreduce([tensor]).wait()
"""

AR_DEFAULT_GROUP_BYPASS = """
def ring_all_reduce(tensor, group=None):
    (group or dist.distributed_c10d._get_default_group()).allreduce([tensor]).wait()
"""

AR_WHOLE_TENSOR_RING = """
def ring_all_reduce(tensor, group=None):
    # the PyTorch tutorial's ring: pass the whole tensor round N - 1 times, add what arrives
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    right, left = (rank + 1) % world, (rank - 1) % world
    send_buf, recv_buf, total = tensor.clone(), torch.empty_like(tensor), tensor.clone()
    for _ in range(world - 1):
        works = [dist.irecv(recv_buf, group=group, group_src=left),
                 dist.isend(send_buf, group=group, group_dst=right)]
        for work in works:
            work.wait()
        total += recv_buf
        send_buf, recv_buf = recv_buf, send_buf
    tensor.copy_(total)
"""

AR_FORGETS_ALL_GATHER = """
def ring_all_reduce(tensor, group=None):
    ring_reduce_scatter(tensor, group)
"""

AR_GATHER_TO_ROOT = """
def ring_all_reduce(tensor, group=None):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank == 0:
        incoming = torch.empty_like(tensor)
        for src in range(1, world):
            dist.recv(incoming, group=group, group_src=src)
            tensor += incoming
        for dst in range(1, world):
            dist.send(tensor, group=group, group_dst=dst)
    else:
        dist.send(tensor, group=group, group_dst=0)
        dist.recv(tensor, group=group, group_src=0)
"""

RS_BASIC = "after ring_reduce_scatter of 8 elements on 4 ranks, its chunk"
AG_BASIC = "rank 0: after ring_all_gather of 8 elements on 4 ranks, chunk"
COLLECTIVE = "ring_all_reduce called the collective `all_reduce`"
ALL_AR = ("test_ring_all_reduce_basic", "test_ring_all_reduce_edge_cases", "test_ring_all_reduce_bandwidth")

VARIANTS = {
    "off_by_one_adds_instead_of_copies_uses_all_reduce": {
        "cells": {"ring_reduce_scatter": RS_OFF_BY_ONE, "ring_all_gather": AG_ADDS_INSTEAD_OF_COPIES,
                  "ring_all_reduce": AR_USES_ALL_REDUCE},
        "loses": {
            "test_ring_reduce_scatter_basic": "its chunk 1 holds the full sum instead: is a chunk index "
                                              "off by one?",
            "test_ring_reduce_scatter_edge_cases": "off by one",
            "test_ring_all_gather_basic": AG_BASIC,
            "test_ring_all_gather_edge_cases": "or was added to the garbage instead of copied over it",
            **{cell: COLLECTIVE for cell in ALL_AR},
        },
    },
    "needs_divisible_length_off_by_one_process_group_bypass": {
        "cells": {"ring_reduce_scatter": RS_NEEDS_DIVISIBLE_LENGTH, "ring_all_gather": AG_OFF_BY_ONE,
                  "ring_all_reduce": AR_PROCESS_GROUP_BYPASS},
        "loses": {
            "test_ring_reduce_scatter_edge_cases": "after ring_reduce_scatter of 7 elements on 3 ranks, "
                                                   "its chunk",
            "test_ring_all_gather_basic": AG_BASIC,
            "test_ring_all_gather_edge_cases": "after ring_all_gather of 7 elements on 3 ranks",
            **{cell: COLLECTIVE + " (c10d::allreduce_)" for cell in ALL_AR},
        },
        "keeps": ["test_ring_reduce_scatter_basic"],
    },
    "deadlock_stops_early_whole_tensor_ring": {
        "cells": {"ring_reduce_scatter": RS_DEADLOCK_RECV_FIRST, "ring_all_gather": AG_STOPS_ONE_STEP_EARLY,
                  "ring_all_reduce": AR_WHOLE_TENSOR_RING},
        "loses": {
            "test_ring_reduce_scatter_basic": "ring_reduce_scatter deadlocked: ranks 0, 1, 2 and 3 of 4",
            "test_ring_reduce_scatter_edge_cases": "blocked in recv from rank",
            "test_ring_all_gather_basic": "the chunk never arrived",
            "test_ring_all_gather_edge_cases": "the chunk never arrived",
            "test_ring_all_reduce_bandwidth": "rank 0 sent 2.0x the bytes of a ring all-reduce",
        },
        "keeps": ["test_ring_all_reduce_basic", "test_ring_all_reduce_edge_cases"],
    },
    "wrong_peer_broadcast_default_group_bypass": {
        "cells": {"ring_reduce_scatter": RS_WRONG_PEER, "ring_all_gather": AG_BROADCASTS_EACH_CHUNK,
                  "ring_all_reduce": AR_DEFAULT_GROUP_BYPASS},
        "loses": {
            "test_ring_reduce_scatter_basic": RS_BASIC,
            "test_ring_reduce_scatter_edge_cases": "Received data size doesn't match expected size",
            "test_ring_all_gather_basic": "ring_all_gather called the collective `broadcast`",
            "test_ring_all_gather_edge_cases": "ring_all_gather called the collective `broadcast`",
            **{cell: COLLECTIVE for cell in ALL_AR},
        },
    },
    "ignores_group_and_forgets_all_gather_phase": {
        "cells": {"ring_reduce_scatter": RS_IGNORES_GROUP, "ring_all_gather": AG_IGNORES_GROUP,
                  "ring_all_reduce": AR_FORGETS_ALL_GATHER},
        "loses": {
            "test_ring_reduce_scatter_edge_cases": "group=new_group of ranks [[0, 2], [1, 3]]",
            "test_ring_all_gather_edge_cases": "group=new_group of ranks [[0, 2], [1, 3]]",
            "test_ring_all_reduce_basic": "rank 0: after ring_all_reduce of 8 elements on 4 ranks, chunk 1",
            "test_ring_all_reduce_edge_cases": "after ring_all_reduce of 7 elements on 3 ranks",
            "test_ring_all_reduce_bandwidth": "after ring_all_reduce of 1000 elements on 4 ranks",
        },
        "keeps": ["test_ring_reduce_scatter_basic", "test_ring_all_gather_basic"],
    },
    "not_in_place_whole_tensor_all_gather_gather_to_root": {
        "cells": {"ring_reduce_scatter": RS_NOT_IN_PLACE, "ring_all_gather": AG_SENDS_THE_WHOLE_TENSOR,
                  "ring_all_reduce": AR_GATHER_TO_ROOT},
        "loses": {
            "test_ring_reduce_scatter_basic": "unchanged from this rank's input: nothing was added into it",
            "test_ring_reduce_scatter_edge_cases": "unchanged from this rank's input",
            "test_ring_all_gather_edge_cases": "rank 0 sent 3.0x the bytes of a ring all-gather",
            "test_ring_all_reduce_bandwidth": "rank 0 sent 2.0x the bytes of a ring all-reduce",
        },
        "keeps": ["test_ring_all_gather_basic", "test_ring_all_reduce_basic",
                  "test_ring_all_reduce_edge_cases"],
    },
}
