"""Long sequences and many experts: the reference ring attention against one process's attention, per token,
and the reference expert-parallel layer against a dense layer of the same FLOPs, same runs, as ratios.

Ring attention: one causal sequence of 2,048 positions, 4 heads of 32 (float32), the head-and-tail split, on
N = 2 and 4 ranks (gloo on the CPU). In each launch, rank 0 also computes the whole sequence's attention
alone (the other ranks wait at the barrier) with the same blockwise function on a single block: the time per
token of the ring (all N ranks busy on their share) over the time per token of one process. Below 1 the ring
is faster per token, above 1 its messages and merges cost more than the split saves (2 cores: N = 4 ranks
share them).

Expert parallelism: each rank's 1,024 tokens of d_model 256 through 2N experts of d_hidden 512, top-2,
capacity factor 1.25, forward and backward (autograder/dpgrader/sequence_and_experts/tuned.py), against a
dense MLP of 256 -> 1,024 -> 256 (the FLOPs of one token's two experts) on the same tokens in the same
launch. The ratio is the price of the routing, the all-to-alls and the uneven expert batches.

Variants run interleaved in one launch (round-robin, the order rotated every round, a barrier before every
step, first round warm-up); ratios are the median over rounds of per-round ratios of median step times.
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "autograder"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dpcourse import launch  # noqa: E402
from dpcourse.runtime.timing import interleaved_step_times  # noqa: E402
from dpcourse.topics.experts.models import dense_twin, mixture  # noqa: E402
from dpcourse.topics.sequence.models import head_tail_positions, inputs  # noqa: E402
from dpcourse.toys.bench import paired_ratios  # noqa: E402
from dpgrader.sequence_and_experts import tuned as reference  # noqa: E402

SEQ, HEADS, D_HEAD = 2048, 4, 32
TOKENS, D_MODEL, D_HIDDEN = 1024, 256, 512
STEPS, ROUNDS = 2, 6


def ring_against_one_process():
    rank, n = dist.get_rank(), dist.get_world_size()
    q, k, v = (inputs((1, HEADS, SEQ, D_HEAD), seed, dtype=torch.float32) for seed in (1, 2, 3))
    positions = head_tail_positions(SEQ, n)
    mine = positions[rank]
    ql, kl, vl = (t.index_select(2, mine).contiguous() for t in (q, k, v))
    everything = torch.arange(SEQ)

    def one_process():
        if rank == 0:
            reference.attention_block(q, k, v, everything, everything, True)

    steps = {"ring attention": lambda: reference.ring_attention(ql, kl, vl, positions, True),
             "one process": one_process}
    return interleaved_step_times(steps, rounds=ROUNDS, repeats=STEPS)


def experts_against_dense():
    n = dist.get_world_size()
    moe = mixture(D_MODEL, D_HIDDEN, 2 * n, k=2, capacity_factor=1.25, seed=0, dtype=torch.float32)
    layer = reference.ExpertParallelMoE(moe)
    dense = dense_twin(moe, dtype=torch.float32)
    x = inputs((TOKENS, D_MODEL), seed=10 + dist.get_rank(), dtype=torch.float32).requires_grad_()

    def expert_step():
        y, aux = layer(x)
        (y.square().mean() + aux).backward()

    def dense_step():
        dense(x).square().mean().backward()

    return interleaved_step_times({"expert parallel": expert_step, "dense": dense_step}, rounds=ROUNDS,
                                  repeats=STEPS)


def main():
    start = time.perf_counter()
    print(f"ring attention: causal, {SEQ} positions, {HEADS} heads of {D_HEAD}, float32, head-and-tail split")
    for n in (2, 4):
        times = launch(ring_against_one_process, n, deadline=600, group_timeout=120)[0]
        ratio = paired_ratios(times, "one process", STEPS)["ring attention"]
        per_token = {name: statistics.median(values) / SEQ * 1e6 for name, values in times.items()}
        print(f"  N={n}: ring {per_token['ring attention']:.2f} us/token, one process "
              f"{per_token['one process']:.2f} us/token: ring / one process = {ratio:.3f}")
    print(f"expert parallelism: {TOKENS} tokens per rank, d_model {D_MODEL}, 2N experts of {D_HIDDEN}, "
          f"top-2, forward + backward, against a dense {D_MODEL} -> {2 * D_HIDDEN} -> {D_MODEL} MLP")
    for n in (2, 4):
        times = launch(experts_against_dense, n, deadline=600, group_timeout=120)[0]
        ratio = paired_ratios(times, "dense", STEPS)["expert parallel"]
        medians = {name: statistics.median(values) * 1e3 for name, values in times.items()}
        print(f"  N={n}: expert-parallel layer {medians['expert parallel']:.1f} ms, dense "
              f"{medians['dense']:.1f} ms per step: expert parallel / dense = {ratio:.3f}")
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
