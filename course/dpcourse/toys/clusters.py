"""The clusters the planners of notebooks 09 and 12 price layouts on: GPUs, their memory and speed, the links.

    c = cluster(nodes=4)              # 4 nodes of 8 A100 80 GB
    gpus(c), link(c, span=8)          # 32, (alpha, beta) of NVLink inside a node

Here, below the topics, because the hybrid planner (09) and the long-context planner (12) describe
the same machines the same way.
"""


def cluster(nodes=32, gpus_per_node=8, memory=80e9, flops=140e12, intra_bandwidth=300e9, inter_bandwidth=25e9,
            intra_latency=5e-6, inter_latency=10e-6):
    """A cluster as a dict. Defaults: A100 80 GB nodes of 8 GPUs, 140 TFLOP/s sustained per GPU (what
    Narayanan et al. 2021 measure end to end for a 76B model, 45 % of the 312 TFLOP/s peak), NVLink at
    300 GB/s and one 200 Gb/s HDR InfiniBand card per GPU (25 GB/s)."""
    return dict(nodes=nodes, gpus_per_node=gpus_per_node, memory=memory, flops=flops,
                intra_bandwidth=intra_bandwidth, inter_bandwidth=inter_bandwidth, intra_latency=intra_latency,
                inter_latency=inter_latency)


def gpus(cluster):
    return cluster["nodes"] * cluster["gpus_per_node"]


def link(cluster, span):
    """(alpha, beta) of a group spanning `span` consecutive ranks: NVLink if it fits a node."""
    if cluster["gpus_per_node"] % span == 0:
        return cluster["intra_latency"], cluster["intra_bandwidth"]
    return cluster["inter_latency"], cluster["inter_bandwidth"]
