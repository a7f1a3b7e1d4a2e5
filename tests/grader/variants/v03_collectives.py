"""Planted bugs for 03_collectives: each must lose the listed cells with a message saying why.

The four exercises are independent, so each variant plants one bug in every exercise (four
variants x four exercises = 16 bugs in four notebook executions).
"""

RING_SHIFT_WRONG_PEER = """
def ring_shift(x):
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        return x.clone()
    right, left = (rank + 1) % world, (rank - 1) % world
    received = torch.empty_like(x)
    if rank % 2 == 0:
        dist.send(x, left)
        dist.recv(received, right)
    else:
        dist.recv(received, right)
        dist.send(x, left)
    return received
"""

RING_SHIFT_EVERYBODY_SENDS_FIRST = """
def ring_shift(x):
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        return x.clone()
    received = torch.empty_like(x)
    dist.send(x, (rank + 1) % world)
    dist.recv(received, (rank - 1) % world)
    return received
"""

RING_SHIFT_SENDS_TO_ITSELF_ON_ONE_RANK = """
def ring_shift(x):
    rank, world = dist.get_rank(), dist.get_world_size()
    received = torch.empty_like(x)
    works = [dist.irecv(received, (rank - 1) % world), dist.isend(x, (rank + 1) % world)]
    for work in works:
        work.wait()
    return received
"""

RING_SHIFT_RECEIVES_INTO_X = """
def ring_shift(x):
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        return x
    outgoing = x.clone()
    works = [dist.isend(outgoing, (rank + 1) % world), dist.irecv(x, (rank - 1) % world)]
    for work in works:
        work.wait()
    return x
"""

NAIVE_USES_ALL_REDUCE = """
def naive_all_reduce(x):
    dist.all_reduce(x)
"""

NAIVE_USES_PROCESS_GROUP = """
def naive_all_reduce(x):
    dist.group.WORLD.allreduce([x]).wait()
"""

NAIVE_FORGETS_BROADCAST = """
def naive_all_reduce(x):
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        incoming = torch.empty_like(x)
        for src in range(1, world):
            dist.recv(incoming, src)
            x += incoming
    else:
        dist.send(x, 0)
"""

NAIVE_NOT_IN_PLACE = """
def naive_all_reduce(x):
    rank, world = dist.get_rank(), dist.get_world_size()
    total = x.clone()
    if rank == 0:
        incoming = torch.empty_like(x)
        for src in range(1, world):
            dist.recv(incoming, src)
            total = total + incoming
        for dst in range(1, world):
            dist.send(total, dst)
    else:
        dist.send(x, 0)
        dist.recv(total, 0)
    return total
"""

BCAST_USES_BROADCAST = """
def p2p_broadcast(x, src=0):
    dist.broadcast(x, src)
"""

BCAST_ONLY_FROM_RANK_0 = """
def p2p_broadcast(x, src=0):
    rank, world = dist.get_rank(), dist.get_world_size()
    mask = 1
    while mask < world:
        if rank & mask:
            dist.recv(x, rank - mask)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if rank + mask < world:
            dist.send(x, rank + mask)
        mask >>= 1
"""

BCAST_POWERS_OF_TWO_ONLY = """
def p2p_broadcast(x, src=0):
    import math
    rank, world = dist.get_rank(), dist.get_world_size()
    me = (rank - src) % world
    rounds = int(math.log2(world))          # floor: one round short when N is not a power of two
    for k in reversed(range(rounds)):
        step = 1 << k
        if me % (2 * step) == 0 and me + step < world:
            dist.send(x, (rank + step) % world)
        elif me % (2 * step) == step:
            dist.recv(x, (rank - step) % world)
"""

BCAST_FLAT = """
def p2p_broadcast(x, src=0):
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == src:
        for dst in range(world):
            if dst != src:
                dist.send(x, dst)
    else:
        dist.recv(x, src)
"""

GATHER_DEFAULT_GROUP_BYPASS = """
def p2p_all_gather(x):
    world = dist.get_world_size()
    out = [torch.empty_like(x) for _ in range(world)]
    dist.distributed_c10d._get_default_group().allgather([out], [x]).wait()
    return out
"""

GATHER_BLOCKING_SENDS_TO_ALL = """
def p2p_all_gather(x):
    rank, world = dist.get_rank(), dist.get_world_size()
    out = [torch.empty_like(x) for _ in range(world)]
    out[rank] = x.clone()
    for other in range(world):
        if other != rank:
            dist.send(x, other)
    for other in range(world):
        if other != rank:
            dist.recv(out[other], other)
    return out
"""

GATHER_ARRIVAL_ORDER = """
def p2p_all_gather(x):
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    out = [x.clone()]
    for step in range(world - 1):
        incoming = torch.empty_like(x)
        works = [dist.irecv(incoming, left), dist.isend(out[-1], right)]
        for work in works:
            work.wait()
        out.append(incoming)
    return out
"""

GATHER_THROUGH_ROOT = """
def p2p_all_gather(x):
    rank, world = dist.get_rank(), dist.get_world_size()
    out = [torch.empty_like(x) for _ in range(world)]
    out[rank] = x.clone()
    if rank == 0:
        for src in range(1, world):
            dist.recv(out[src], src)
        for dst in range(1, world):
            for i in range(world):
                if i != dst:
                    dist.send(out[i], dst)
    else:
        dist.send(x, 0)
        for i in range(world):
            if i != rank:
                dist.recv(out[i], 0)
    return out
"""

VARIANTS = {
    "wrong_peer_and_built_in_collectives": {
        "cells": {"ring_shift": RING_SHIFT_WRONG_PEER, "naive_all_reduce": NAIVE_USES_ALL_REDUCE,
                  "p2p_broadcast": BCAST_USES_BROADCAST, "p2p_all_gather": GATHER_DEFAULT_GROUP_BYPASS},
        "loses": {
            "test_ring_shift_basic": "rank 0: ring_shift(x) returned rank 1's tensor",
            "test_ring_shift_any_n": "expected rank 2's",
            "test_naive_all_reduce_basic": "naive_all_reduce called the collective `all_reduce`",
            "test_naive_all_reduce_edge_cases": "called the collective `all_reduce`",
            "test_p2p_broadcast_basic": "p2p_broadcast called the collective `broadcast`",
            "test_p2p_broadcast_edge_cases": "called the collective `broadcast`",
            "test_p2p_all_gather_basic": "p2p_all_gather called the collective `all_gather`",
            "test_p2p_all_gather_edge_cases": "called the collective `all_gather`",
        },
    },
    "deadlocks_and_the_process_group_bypass": {
        "cells": {"ring_shift": RING_SHIFT_EVERYBODY_SENDS_FIRST,
                  "naive_all_reduce": NAIVE_USES_PROCESS_GROUP, "p2p_broadcast": BCAST_ONLY_FROM_RANK_0,
                  "p2p_all_gather": GATHER_BLOCKING_SENDS_TO_ALL},
        "loses": {
            "test_ring_shift_basic": "ring_shift deadlocked: ranks 0, 1, 2 and 3 of 4",
            "test_ring_shift_any_n": "blocked in send to rank",
            "test_naive_all_reduce_basic": "naive_all_reduce called the collective `all_reduce`",
            "test_naive_all_reduce_edge_cases": "c10d::allreduce_",
            "test_p2p_broadcast_edge_cases": "rank 0: x after p2p_broadcast(x, src=2) on 5 ranks holds "
                                             "rank 0's tensor",
            "test_p2p_all_gather_basic": "p2p_all_gather deadlocked",
            "test_p2p_all_gather_edge_cases": "deadlocked",
        },
        "keeps": ["test_p2p_broadcast_basic"],
    },
    "edge_cases_one_rank_no_broadcast_back_not_power_of_two_arrival_order": {
        "cells": {"ring_shift": RING_SHIFT_SENDS_TO_ITSELF_ON_ONE_RANK,
                  "naive_all_reduce": NAIVE_FORGETS_BROADCAST, "p2p_broadcast": BCAST_POWERS_OF_TWO_ONLY,
                  "p2p_all_gather": GATHER_ARRIVAL_ORDER},
        "loses": {
            "test_ring_shift_any_n": "ring_shift: rank 0 sent to or received from itself",
            "test_naive_all_reduce_basic": "rank 1: x after naive_all_reduce(x)",
            "test_naive_all_reduce_edge_cases": "rank 1: x after naive_all_reduce of random floats is",
            "test_p2p_broadcast_edge_cases": "rank 1: x after p2p_broadcast(x, src=2) on 5 ranks holds "
                                             "rank 1's tensor",
            "test_p2p_all_gather_basic": "rank 0: p2p_all_gather on 4 ranks: entry 1 of the list is "
                                         "rank 3's x",
            "test_p2p_all_gather_edge_cases": "entry 1 of the list is rank 2's x",
        },
        "keeps": ["test_ring_shift_basic", "test_p2p_broadcast_basic"],
    },
    "modifies_x_not_in_place_flat_broadcast_gather_through_root": {
        "cells": {"ring_shift": RING_SHIFT_RECEIVES_INTO_X, "naive_all_reduce": NAIVE_NOT_IN_PLACE,
                  "p2p_broadcast": BCAST_FLAT, "p2p_all_gather": GATHER_THROUGH_ROOT},
        "loses": {
            "test_ring_shift_any_n": "ring_shift modified its input x",
            "test_naive_all_reduce_basic": "rank 0: x after naive_all_reduce(x) (it works in place",
            "test_naive_all_reduce_edge_cases": "x after naive_all_reduce",
            "test_p2p_broadcast_edge_cases": "rank 2 sent 4 messages; in a tree (or a ring) no rank sends "
                                             "more than ⌈log2 5⌉ = 3",
            "test_p2p_all_gather_basic": "rank 0 sent 3.0x the bytes an all-gather needs",
            "test_p2p_all_gather_edge_cases": "the bytes an all-gather needs",
        },
        "keeps": ["test_ring_shift_basic", "test_p2p_broadcast_basic"],
    },
}
