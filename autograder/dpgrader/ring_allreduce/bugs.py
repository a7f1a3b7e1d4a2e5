"""Planted bugs for 04_ring_allreduce: each must lose the listed cells with a message saying why.

ring_all_reduce may call the learner's ring_reduce_scatter and ring_all_gather, so a variant
that breaks those pairs them with an all-reduce bug that does not call them (a collective, a
bypass, a whole-tensor ring, a root), and the variant whose all-reduce uses them ("forgets the
all-gather phase") breaks them only where the all-reduce fails anyway. Six variants, six bugs
per exercise.
"""

from dpgrader.planted import Bug, Variant

# ---- ring_reduce_scatter and ring_all_gather: the lines the bugs edit -----------------------------
GROUP_RANKS = "    world, rank = dist.get_world_size(group), dist.get_rank(group)\n"
CHUNKS = "    chunks = tensor.view(-1).tensor_split(world)\n"
RS_INDICES = "        send_i, recv_i = (rank - step - 1) % world, (rank - step - 2) % world\n"
AG_INDICES = "        send_i, recv_i = (rank - step) % world, (rank - step - 1) % world\n"
RS_POST = ("        works = [dist.irecv(buffer, group=group, group_src=left),\n"
           "                 dist.isend(chunks[send_i], group=group, group_dst=right)]\n")
AG_POST = ("        works = [dist.irecv(chunks[recv_i], group=group, group_src=left),\n"
           "                 dist.isend(chunks[send_i], group=group, group_dst=right)]\n")
WAIT = ("        for work in works:\n"
        "            work.wait()\n")

RS_BASIC = "after ring_reduce_scatter of 8 elements on 4 ranks, its chunk"
AG_BASIC = "rank 0: after ring_all_gather of 8 elements on 4 ranks, chunk"
COLLECTIVE = "ring_all_reduce called the collective `all_reduce`"
ALL_AR = ("test_ring_all_reduce_basic", "test_ring_all_reduce_edge_cases", "test_ring_all_reduce_bandwidth")


def ring_all_reduce_source(body):
    """ring_all_reduce rewritten: `body` instead of the reduce-scatter and the all-gather."""
    return "def ring_all_reduce(tensor, group=None):\n" + body


BUGS = [
    Variant("off_by_one_adds_instead_of_copies_uses_all_reduce", [
        Bug("ring_reduce_scatter", "reduce_scatter_chunk_off_by_one",
            patch=[(RS_INDICES, AG_INDICES)],
            loses={"test_ring_reduce_scatter_basic":
                   "its chunk 1 holds the full sum instead: is a chunk index off by one?",
                   "test_ring_reduce_scatter_edge_cases": "off by one"}),
        Bug("ring_all_gather", "adds_instead_of_copies",
            patch=[("    right, left = (rank + 1) % world, (rank - 1) % world\n",
                    "    right, left = (rank + 1) % world, (rank - 1) % world\n"
                    "    incoming = torch.empty_like(chunks[0])\n"),
                   (AG_INDICES + AG_POST + WAIT,
                    AG_INDICES + "        buffer = incoming[:chunks[recv_i].numel()]\n"
                    + AG_POST.replace("irecv(chunks[recv_i]", "irecv(buffer") + WAIT
                    + "        chunks[recv_i].add_(buffer)\n")],
            loses={"test_ring_all_gather_basic": AG_BASIC,
                   "test_ring_all_gather_edge_cases": "or was added to the garbage instead of copied over it"}),
        Bug("ring_all_reduce", "uses_dist_all_reduce",  # a rewrite: the built-in does it all
            source=ring_all_reduce_source("    dist.all_reduce(tensor, group=group)\n"),
            loses={cell: COLLECTIVE for cell in ALL_AR}),
    ]),
    Variant("needs_divisible_length_off_by_one_process_group_bypass", [
        Bug("ring_reduce_scatter", "needs_a_divisible_length",
            patch=[(CHUNKS, "    n = tensor.numel() // world  # drops the remainder: equal chunks only\n"
                            "    chunks = [tensor.view(-1)[i * n:(i + 1) * n] for i in range(world)]\n")],
            loses={"test_ring_reduce_scatter_edge_cases": "after ring_reduce_scatter of 7 elements on 3 ranks, "
                                                          "its chunk"},
            keeps=["test_ring_reduce_scatter_basic"]),
        Bug("ring_all_gather", "all_gather_chunk_off_by_one",
            patch=[(AG_INDICES, RS_INDICES)],
            loses={"test_ring_all_gather_basic": AG_BASIC,
                   "test_ring_all_gather_edge_cases": "after ring_all_gather of 7 elements on 3 ranks"}),
        Bug("ring_all_reduce", "process_group_bypass",  # a rewrite: the process group's own all-reduce
            source=ring_all_reduce_source("    (group or dist.group.WORLD).allreduce([tensor]).wait()\n"),
            loses={cell: COLLECTIVE + " (c10d::allreduce_)" for cell in ALL_AR}),
    ]),
    Variant("deadlock_stops_early_whole_tensor_ring", [
        Bug("ring_reduce_scatter", "blocking_receive_first",
            patch=[(RS_POST + WAIT, "        dist.recv(buffer, group=group, group_src=left)\n"
                                    "        dist.send(chunks[send_i], group=group, group_dst=right)\n")],
            loses={"test_ring_reduce_scatter_basic": "ring_reduce_scatter deadlocked: ranks 0, 1, 2 and 3 of 4",
                   "test_ring_reduce_scatter_edge_cases": "blocked in recv from rank"}),
        Bug("ring_all_gather", "stops_one_step_early",
            patch=[("    for step in range(world - 1):\n", "    for step in range(world - 2):\n")],
            loses={"test_ring_all_gather_basic": "the chunk never arrived",
                   "test_ring_all_gather_edge_cases": "the chunk never arrived"}),
        Bug("ring_all_reduce", "whole_tensor_ring",  # a rewrite: the PyTorch tutorial's ring
            source=ring_all_reduce_source(
                "    world, rank = dist.get_world_size(group), dist.get_rank(group)\n"
                "    right, left = (rank + 1) % world, (rank - 1) % world\n"
                "    send_buf, recv_buf, total = tensor.clone(), torch.empty_like(tensor), tensor.clone()\n"
                "    for _ in range(world - 1):  # pass the whole tensor round N - 1 times, add what arrives\n"
                "        works = [dist.irecv(recv_buf, group=group, group_src=left),\n"
                "                 dist.isend(send_buf, group=group, group_dst=right)]\n"
                "        for work in works:\n"
                "            work.wait()\n"
                "        total += recv_buf\n"
                "        send_buf, recv_buf = recv_buf, send_buf\n"
                "    tensor.copy_(total)\n"),
            loses={"test_ring_all_reduce_bandwidth": "rank 0 sent 2.0x the bytes of a ring all-reduce"},
            keeps=["test_ring_all_reduce_basic", "test_ring_all_reduce_edge_cases"]),
    ]),
    Variant("wrong_peer_broadcast_default_group_bypass", [
        Bug("ring_reduce_scatter", "receives_from_the_right",
            patch=[(RS_POST, RS_POST.replace("group_src=left", "group_src=right")
                    .replace("group_dst=right", "group_dst=left"))],
            loses={"test_ring_reduce_scatter_basic": RS_BASIC,
                   "test_ring_reduce_scatter_edge_cases": "Received data size doesn't match expected size"}),
        Bug("ring_all_gather", "broadcasts_each_chunk",  # a rewrite: one built-in broadcast per chunk
            source="def ring_all_gather(tensor, group=None):\n"
                   "    world = dist.get_world_size(group)\n"
                   "    for owner, chunk in enumerate(tensor.view(-1).tensor_split(world)):\n"
                   "        dist.broadcast(chunk.clone(), group=group, group_src=owner)\n",
            loses={"test_ring_all_gather_basic": "ring_all_gather called the collective `broadcast`",
                   "test_ring_all_gather_edge_cases": "ring_all_gather called the collective `broadcast`"}),
        Bug("ring_all_reduce", "default_group_bypass",  # a rewrite: the default group's own all-reduce
            source=ring_all_reduce_source(
                "    (group or dist.distributed_c10d._get_default_group()).allreduce([tensor]).wait()\n"),
            loses={cell: COLLECTIVE for cell in ALL_AR}),
    ]),
    Variant("ignores_group_and_forgets_all_gather_phase", [
        Bug("ring_reduce_scatter", "reduce_scatter_ignores_the_group",
            patch=[(GROUP_RANKS, "    world, rank = dist.get_world_size(), dist.get_rank()\n"),
                   (RS_POST, "        works = [dist.irecv(buffer, left), dist.isend(chunks[send_i], right)]\n")],
            loses={"test_ring_reduce_scatter_edge_cases": "group=new_group of ranks [[0, 2], [1, 3]]"},
            keeps=["test_ring_reduce_scatter_basic"]),
        Bug("ring_all_gather", "all_gather_ignores_the_group",
            patch=[(GROUP_RANKS, "    world, rank = dist.get_world_size(), dist.get_rank()\n"),
                   (AG_POST, "        works = [dist.irecv(chunks[recv_i], left), dist.isend(chunks[send_i], right)]\n")],
            loses={"test_ring_all_gather_edge_cases": "group=new_group of ranks [[0, 2], [1, 3]]"},
            keeps=["test_ring_all_gather_basic"]),
        Bug("ring_all_reduce", "forgets_the_all_gather_phase",
            patch=[("    ring_all_gather(tensor, group)\n", "")],
            loses={"test_ring_all_reduce_basic": "rank 0: after ring_all_reduce of 8 elements on 4 ranks, chunk 1",
                   "test_ring_all_reduce_edge_cases": "after ring_all_reduce of 7 elements on 3 ranks",
                   "test_ring_all_reduce_bandwidth": "after ring_all_reduce of 1000 elements on 4 ranks"}),
    ]),
    Variant("not_in_place_whole_tensor_all_gather_gather_to_root", [
        Bug("ring_reduce_scatter", "not_in_place",
            patch=[(GROUP_RANKS, GROUP_RANKS + "    tensor = tensor.clone()  # works on a copy: the caller's "
                                               "tensor never changes\n"),
                   ("        chunks[recv_i].add_(buffer)\n", "        chunks[recv_i].add_(buffer)\n    return tensor\n")],
            loses={"test_ring_reduce_scatter_basic": "unchanged from this rank's input: nothing was added into it",
                   "test_ring_reduce_scatter_edge_cases": "unchanged from this rank's input"}),
        Bug("ring_all_gather", "sends_the_whole_tensor",  # a rewrite: every step sends all of it
            source="def ring_all_gather(tensor, group=None):\n"
                   "    world, rank = dist.get_world_size(group), dist.get_rank(group)\n"
                   "    flat = tensor.view(-1)\n"
                   "    chunks = flat.tensor_split(world)\n"
                   "    right, left = (rank + 1) % world, (rank - 1) % world\n"
                   "    incoming = torch.empty_like(flat)\n"
                   "    for step in range(world - 1):\n"
                   "        recv_i = (rank - step - 1) % world\n"
                   "        works = [dist.irecv(incoming, group=group, group_src=left),\n"
                   "                 dist.isend(flat.clone(), group=group, group_dst=right)]\n"
                   "        for work in works:\n"
                   "            work.wait()\n"
                   "        chunks[recv_i].copy_(incoming.tensor_split(world)[recv_i])\n",
            loses={"test_ring_all_gather_edge_cases": "rank 0 sent 3.0x the bytes of a ring all-gather"},
            keeps=["test_ring_all_gather_basic"]),
        Bug("ring_all_reduce", "gathers_to_a_root",  # a rewrite: notebook 03's naive all-reduce
            source=ring_all_reduce_source(
                "    world, rank = dist.get_world_size(group), dist.get_rank(group)\n"
                "    if rank == 0:\n"
                "        incoming = torch.empty_like(tensor)\n"
                "        for src in range(1, world):\n"
                "            dist.recv(incoming, group=group, group_src=src)\n"
                "            tensor += incoming\n"
                "        for dst in range(1, world):\n"
                "            dist.send(tensor, group=group, group_dst=dst)\n"
                "    else:\n"
                "        dist.send(tensor, group=group, group_dst=0)\n"
                "        dist.recv(tensor, group=group, group_src=0)\n"),
            loses={"test_ring_all_reduce_bandwidth": "rank 0 sent 2.0x the bytes of a ring all-reduce"},
            keeps=["test_ring_all_reduce_basic", "test_ring_all_reduce_edge_cases"]),
    ]),
]
