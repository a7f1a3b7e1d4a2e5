"""dpcourse.topics.sequence.costs: the formulas of notebook 12's planner and written answer."""

from dpcourse.topics.sequence.costs import (
    LLAMA_7B_128K,
    activation_bytes,
    expert_traffic,
    long_context_plan,
    ring_vs_ulysses,
    traffic,
)
from dpcourse.toys.clusters import cluster
from markers import chapter

pytestmark = chapter("sequence_and_experts")


def test_activation_memory_follows_korthikanti_et_al():
    s, b, h, a = 2048, 1, 4096, 32
    assert activation_bytes(s, b, h, a, scores=True) == s * b * h * (34 + 5 * a * s / h)
    tp_only = s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8))
    assert activation_bytes(s, b, h, a, tp=8, scores=True) == tp_only
    assert activation_bytes(s, b, h, a, tp=8, sp=True, scores=True) == s * b * h / 8 * (34 + 5 * a * s / h)
    # sequence parallelism divides the 10·sbh tensor parallelism leaves whole; context parallelism divides all
    tp_sp = activation_bytes(s, b, h, a, tp=8, sp=True)
    assert activation_bytes(s, b, h, a, tp=8, sp=True, cp=4) * 4 == tp_sp


def test_tp_sp_sends_what_tp_all_reduces_and_ulysses_sends_n_over_2_less_than_the_ring():
    S = 4096 * 2 * 1024 * 2
    assert traffic("tp_sp", 4096, 2, 1024, 8)["bytes"] == 4 * 2 * 7 / 8 * S  # four ring all-reduces
    for n in (2, 4, 8):
        assert ring_vs_ulysses(4096, 1, 1024, n)["ratio"] == n / 2
    assert traffic("ring", 4096, 1, 1024, 1)["bytes"] == 0
    assert expert_traffic(4096, 4096, 2, 8) == 4 * 7 / 8 * 2 * 4096 * 4096 * 2


def test_the_plan_puts_fitting_layouts_first_and_tp_sp_alone_does_not_fit_128k_tokens():
    rows = long_context_plan(LLAMA_7B_128K, cluster(nodes=4))
    fits = [r["fits"] for r in rows]
    assert fits[0] and fits == sorted(fits, reverse=True)
    alone = next(r for r in rows if r["tp"] == 8 and r["cp"] == 1)
    assert not alone["fits"] and 80e9 < alone["memory"] < 90e9
    assert all(r["time"] <= rows[i + 1]["time"] for i, r in enumerate(rows[:3]) if rows[i + 1]["fits"])
    ulysses = [r for r in rows if r["method"] == "ulysses" and r["tp"] == 8]
    assert all(r["possible"] == (r["cp"] <= 4) for r in ulysses)  # 32 heads / 8: at most 4-way


def torchs_ring_backward_messages():
    """torch's own ring attention backward on this rank (the CPU kernel, no load balancing, blocks passed to
    the next rank): the messages it sends, as the recorder sees them."""
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    from dpcourse.comm.recorder import CommRecorder

    warnings.simplefilter("ignore")
    cp._cp_options.enable_load_balance = False  # (this rank's own copy: a forked process)
    cp.set_rotate_method("alltoall")
    g = torch.Generator().manual_seed(dist.get_rank())
    q, k, v, dout = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(4))
    with CommRecorder() as rec:
        cp._templated_ring_attention_backward(
            dist.group.WORLD, 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            dout, "grad_out", q, k, v, torch.zeros_like(q), torch.zeros(1, 2, 4), False, dropout_p=0.0)
    return [(o.op, o.nbytes) for o in rec.ops]


def test_the_ring_backward_sends_2n_minus_1_blocks_as_torchs_does():
    """Backward, K and V travel N - 1 hops and dK, dV N (torch 2.13's _templated_ring_attention_backward,
    run here): with the forward's N - 1, (3N - 2) messages of 2S/N per rank, not 3(N - 1)."""
    from dpcourse import launch

    n, block = 3, 2 * 2 * 4 * 8 * 4  # K and V of a (1, 2, 4, 8) float32 block
    for messages in launch(torchs_ring_backward_messages, n, deadline=120):
        assert messages == [("all_to_all_single", block)] * (2 * n - 1), messages
    S = 4096 * 1 * 1024 * 2
    for ranks in (2, 4, 8):
        assert traffic("ring", 4096, 1, 1024, ranks) == {"bytes": (3 * ranks - 2) * 2 * S / ranks,
                                                          "messages": 3 * ranks - 2}
    assert traffic("ring", 4096, 1, 1024, 4)["bytes"] == 5 * S
