"""Planted bugs for 03_collectives: each must lose the listed cells with a message saying why.

The four exercises are independent, so each graded variant plants one bug in every exercise (four
variants x four exercises = 16 bugs in four notebook executions).
"""

from dpgrader.planted import Bug, Variant

EVEN_ODD = ("    if rank % 2 == 0:  # even ranks send first, odd ranks receive first: no cycle of waiting ranks\n"
            "        dist.send(x, right)\n"
            "        dist.recv(received, left)\n"
            "    else:\n"
            "        dist.recv(received, left)\n"
            "        dist.send(x, right)\n")
COLLECTIVE = "called the collective"

BUGS = [
    Variant("wrong_peer_and_built_in_collectives", [
        Bug("ring_shift", "sends_left_receives_right",
            patch=[(EVEN_ODD, EVEN_ODD.replace("(x, right)", "(x, left)").replace("(received, left)",
                                                                                   "(received, right)"))],
            loses={"test_ring_shift_basic": "rank 0: ring_shift(x) returned rank 1's tensor",
                   "test_ring_shift_any_n": "expected rank 2's"}),
        Bug("naive_all_reduce", "uses_dist_all_reduce",  # a rewrite: the built-in does it all
            source="def naive_all_reduce(x):\n    dist.all_reduce(x)\n",
            loses={"test_naive_all_reduce_basic": "naive_all_reduce called the collective `all_reduce`",
                   "test_naive_all_reduce_edge_cases": "called the collective `all_reduce`"}),
        Bug("p2p_broadcast", "uses_dist_broadcast",  # a rewrite: the built-in does it all
            source="def p2p_broadcast(x, src=0):\n    dist.broadcast(x, src)\n",
            loses={"test_p2p_broadcast_basic": "p2p_broadcast called the collective `broadcast`",
                   "test_p2p_broadcast_edge_cases": "called the collective `broadcast`"}),
        Bug("p2p_all_gather", "default_group_bypass",  # a rewrite: the process group's own all-gather
            source="def p2p_all_gather(x):\n"
                   "    world = dist.get_world_size()\n"
                   "    out = [torch.empty_like(x) for _ in range(world)]\n"
                   "    dist.distributed_c10d._get_default_group().allgather([out], [x]).wait()\n"
                   "    return out\n",
            loses={"test_p2p_all_gather_basic": "p2p_all_gather called the collective `all_gather`",
                   "test_p2p_all_gather_edge_cases": "called the collective `all_gather`"}),
    ]),
    Variant("deadlocks_and_the_process_group_bypass", [
        Bug("ring_shift", "every_rank_sends_first",
            patch=[(EVEN_ODD, "    dist.send(x, right)\n"
                              "    dist.recv(received, left)\n")],
            loses={"test_ring_shift_basic": "ring_shift deadlocked: ranks 0, 1, 2 and 3 of 4",
                   "test_ring_shift_any_n": "blocked in send to rank"}),
        Bug("naive_all_reduce", "process_group_bypass",  # a rewrite: the process group's own all-reduce
            source="def naive_all_reduce(x):\n    dist.group.WORLD.allreduce([x]).wait()\n",
            loses={"test_naive_all_reduce_basic": "naive_all_reduce called the collective `all_reduce`",
                   "test_naive_all_reduce_edge_cases": "c10d::allreduce_"}),
        Bug("p2p_broadcast", "tree_rooted_at_rank_0",
            patch=[("    me = (rank - src) % world  # my position in a tree rooted at src\n", "    me = rank\n")],
            loses={"test_p2p_broadcast_edge_cases":
                   "rank 0: x after p2p_broadcast(x, src=2) on 5 ranks holds rank 0's tensor"},
            keeps=["test_p2p_broadcast_basic"]),
        Bug("p2p_all_gather", "blocking_sends_to_every_rank",  # a rewrite: all-to-all with blocking sends
            source="def p2p_all_gather(x):\n"
                   "    rank, world = dist.get_rank(), dist.get_world_size()\n"
                   "    out = [torch.empty_like(x) for _ in range(world)]\n"
                   "    out[rank] = x.clone()\n"
                   "    for other in range(world):\n"
                   "        if other != rank:\n"
                   "            dist.send(x, other)\n"
                   "    for other in range(world):\n"
                   "        if other != rank:\n"
                   "            dist.recv(out[other], other)\n"
                   "    return out\n",
            loses={"test_p2p_all_gather_basic": "p2p_all_gather deadlocked",
                   "test_p2p_all_gather_edge_cases": "deadlocked"}),
    ]),
    Variant("edge_cases_one_rank_no_broadcast_back_not_power_of_two_arrival_order", [
        Bug("ring_shift", "talks_to_itself_on_one_rank",  # a rewrite: non-blocking, no single-rank case
            source="def ring_shift(x):\n"
                   "    rank, world = dist.get_rank(), dist.get_world_size()\n"
                   "    received = torch.empty_like(x)\n"
                   "    works = [dist.irecv(received, (rank - 1) % world), dist.isend(x, (rank + 1) % world)]\n"
                   "    for work in works:\n"
                   "        work.wait()\n"
                   "    return received\n",
            loses={"test_ring_shift_any_n": "ring_shift: rank 0 sent to or received from itself"},
            keeps=["test_ring_shift_basic"]),
        Bug("naive_all_reduce", "no_broadcast_back",
            patch=[("        for dst in range(1, world):\n            dist.send(x, dst)\n", ""),
                   ("        dist.recv(x, 0)\n", "")],
            loses={"test_naive_all_reduce_basic": "rank 1: x after naive_all_reduce(x)",
                   "test_naive_all_reduce_edge_cases": "rank 1: x after naive_all_reduce of random floats is"}),
        Bug("p2p_broadcast", "powers_of_two_only",  # a rewrite: log2(N) rounds, one short when N is no power of 2
            source="def p2p_broadcast(x, src=0):\n"
                   "    import math\n"
                   "    rank, world = dist.get_rank(), dist.get_world_size()\n"
                   "    me = (rank - src) % world\n"
                   "    rounds = int(math.log2(world))  # floor: one round short when N is not a power of two\n"
                   "    for k in reversed(range(rounds)):\n"
                   "        step = 1 << k\n"
                   "        if me % (2 * step) == 0 and me + step < world:\n"
                   "            dist.send(x, (rank + step) % world)\n"
                   "        elif me % (2 * step) == step:\n"
                   "            dist.recv(x, (rank - step) % world)\n",
            loses={"test_p2p_broadcast_edge_cases":
                   "rank 1: x after p2p_broadcast(x, src=2) on 5 ranks holds rank 1's tensor"},
            keeps=["test_p2p_broadcast_basic"]),
        Bug("p2p_all_gather", "arrival_order",
            patch=[("    return gathered\n", "    return [gathered[(rank - i) % world] for i in range(world)]\n")],
            loses={"test_p2p_all_gather_basic": "rank 0: p2p_all_gather on 4 ranks: entry 1 of the list is rank 3's x",
                   "test_p2p_all_gather_edge_cases": "entry 1 of the list is rank 2's x"}),
    ]),
    Variant("modifies_x_not_in_place_flat_broadcast_gather_through_root", [
        Bug("ring_shift", "receives_into_x",
            patch=[("    received = torch.empty_like(x)\n",
                    "    received, x = x, x.clone()  # receives into the caller's tensor\n")],
            loses={"test_ring_shift_any_n": "ring_shift modified its input x"},
            keeps=["test_ring_shift_basic"]),
        Bug("naive_all_reduce", "not_in_place",
            patch=[("    rank, world = dist.get_rank(), dist.get_world_size()\n",
                    "    rank, world = dist.get_rank(), dist.get_world_size()\n"
                    "    x = x.clone()  # works on a copy: the caller's x never changes\n"),
                   ("        dist.recv(x, 0)\n", "        dist.recv(x, 0)\n    return x\n")],
            loses={"test_naive_all_reduce_basic": "rank 0: x after naive_all_reduce(x) (it works in place",
                   "test_naive_all_reduce_edge_cases": "x after naive_all_reduce"}),
        Bug("p2p_broadcast", "flat_broadcast",  # a rewrite: the source sends to every rank
            source="def p2p_broadcast(x, src=0):\n"
                   "    rank, world = dist.get_rank(), dist.get_world_size()\n"
                   "    if rank == src:\n"
                   "        for dst in range(world):\n"
                   "            if dst != src:\n"
                   "                dist.send(x, dst)\n"
                   "    else:\n"
                   "        dist.recv(x, src)\n",
            loses={"test_p2p_broadcast_edge_cases":
                   "rank 2 sent 4 messages; in a tree (or a ring) no rank sends more than ⌈log2 5⌉ = 3"},
            keeps=["test_p2p_broadcast_basic"]),
        Bug("p2p_all_gather", "gathers_through_the_root",  # a rewrite: rank 0 collects and redistributes
            source="def p2p_all_gather(x):\n"
                   "    rank, world = dist.get_rank(), dist.get_world_size()\n"
                   "    out = [torch.empty_like(x) for _ in range(world)]\n"
                   "    out[rank] = x.clone()\n"
                   "    if rank == 0:\n"
                   "        for src in range(1, world):\n"
                   "            dist.recv(out[src], src)\n"
                   "        for dst in range(1, world):\n"
                   "            for i in range(world):\n"
                   "                if i != dst:\n"
                   "                    dist.send(out[i], dst)\n"
                   "    else:\n"
                   "        dist.send(x, 0)\n"
                   "        for i in range(world):\n"
                   "            if i != rank:\n"
                   "                dist.recv(out[i], 0)\n"
                   "    return out\n",
            loses={"test_p2p_all_gather_basic": "rank 0 sent 3.0x the bytes an all-gather needs",
                   "test_p2p_all_gather_edge_cases": "the bytes an all-gather needs"}),
    ]),
    Bug("ring_shift", "returns_x_itself_on_one_rank",  # the text says: on one rank, return a copy
        patch=[("        return x.clone()\n", "        return x\n")],
        loses={"test_ring_shift_any_n": "rank 0: ring_shift(x) on a single rank returned x itself"},
        keeps=["test_ring_shift_basic"]),
]
