"""dpcourse.topics.ddp.timeline and dpcourse.toys.bench, on the reference bucketed DDP (grader side)."""

import matplotlib
import torch

matplotlib.use("Agg")

from dpcourse import launch  # noqa: E402
from dpcourse.topics.ddp.timeline import (  # noqa: E402
    exposed_communication,
    plot_timeline,
    record_timelines,
    timeline_explorer,
)
from dpcourse.toys.bench import compare_step_times, paired_ratios, print_ratios  # noqa: E402
from dpcourse.toys.models import deep_mlp  # noqa: E402
from dpgrader.ddp_from_scratch.checks import expected_buckets  # noqa: E402
from dpgrader.ddp_from_scratch.tuned import ReferenceDDP  # noqa: E402
from markers import chapter, exercise  # noqa: E402

CAPS = [2**14, 2**20]


@exercise("bucketed_ddp")
def test_a_recorded_step_shows_layers_buckets_and_overlap():
    per_rank = launch(record_timelines, 2, ReferenceDDP, CAPS, depth=4, width=64, per_rank=16)
    assert len(per_rank) == 2 and all(len(summaries) == len(CAPS) for summaries in per_rank)
    module = deep_mlp(4, 64, d_in=64, d_out=64)
    for summaries in per_rank:
        for cap, summary in zip(CAPS, summaries, strict=True):
            comms, marks = summary["comms"], summary["marks"]
            assert [op for op, *_ in comms] == ["all_reduce"] * len(expected_buckets(module, cap))
            assert [layer for layer, *_ in summary["compute"]] == ["head", "fc3", "fc2", "fc1", "fc0"]
            assert all(start <= stop for _, _, start, stop in comms)
            assert 0 < marks["backward_end"] <= marks["synced"]
            assert exposed_communication(summary) >= 0
        small = summaries[0]
        assert small["comms"][0][2] < small["marks"]["backward_end"], "the first bucket overlaps backward"
    assert plot_timeline([s[0] for s in per_rank]) is not None
    assert timeline_explorer(per_rank, CAPS) is not None


def _torch_like(module):
    ddp = ReferenceDDP(module, bucket_cap=2**16)
    return ddp, ddp.finish_gradient_sync


@exercise("bucketed_ddp")
def test_step_times_are_compared_interleaved(capsys):
    medians = compare_step_times({"a": _torch_like, "b": _torch_like}, 2, depth=2, width=32, steps=2,
                                 rounds=2)
    assert set(medians) == {"a", "b"} and all(m > 0 for m in medians.values())
    print_ratios({2: medians}, baseline="a")
    assert "1.00x" in capsys.readouterr().out


def test_paired_ratios_compare_each_round_with_the_baselines_same_round():
    # rounds of 2 steps: a = [1, 1 | 2, 2], b = [2, 2 | 2, 2] -> per-round ratios 2.0 and 1.0
    assert paired_ratios({"a": [1, 1, 2, 2], "b": [2, 2, 2, 2]}, "a", 2) == {"a": 1.0, "b": 1.5}


def _hook_threads():
    import threading

    import torch.distributed as dist

    from dpcourse.comm.recorder import CommRecorder

    model = deep_mlp(depth=3)
    threads, works = set(), []

    def hook(param):
        threads.add(threading.get_ident())
        works.append(dist.all_reduce(param.grad, async_op=True))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    x = torch.zeros(4, 8, dtype=torch.float64)
    with CommRecorder() as rec:
        model(x).sum().backward()
    for work in works:
        work.wait()
    return threads == {threading.get_ident()}, rec.count("all_reduce")


@chapter("ddp_from_scratch")
def test_gradient_hooks_run_in_the_calling_thread_where_the_recorder_sees_them():
    """What the checks of notebook 05 rely on (on the CPU): hooks run in the thread that called backward."""
    for same_thread, all_reduces in launch(_hook_threads, 2):
        assert same_thread and all_reduces == 8


@exercise("bucketed_ddp")
def test_waiting_and_copying_split_the_time_after_backward():
    """The band after backward is two things: waiting for the last all-reduce, then copying back."""
    from dpcourse.topics.ddp.timeline import waiting_and_copying

    summary = {"marks": {"backward_end": 1.0, "synced": 4.0}, "comms": [("all_reduce", 8, 0.5, 3.0)]}
    assert waiting_and_copying(summary) == (2.0, 1.0)
    done_early = {"marks": {"backward_end": 1.0, "synced": 1.5}, "comms": [("all_reduce", 8, 0.2, 0.8)]}
    assert waiting_and_copying(done_early) == (0.0, 0.5)
