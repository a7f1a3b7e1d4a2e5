"""costmodel: the alpha-beta formulas, bandwidth conventions and a real (tiny) timing run."""

import math

import pytest
import torch.distributed as dist

from dpcourse import LaunchError, launch
from dpcourse.comm.volume import messages_and_bytes, predicted_time
from dpcourse.topics.collectives.costmodel import busbw, fit_alpha_beta, print_bandwidth, time_all_reduces
from markers import chapter, exercise


@exercise("ring_all_reduce")
def test_busbw_follows_nccl_tests():
    assert busbw(1e9, 1.0, 2) == pytest.approx(1e9)
    assert busbw(1e9, 1.0, 8) == pytest.approx(1e9 * 14 / 8)


@chapter("ddp_in_practice")
def test_the_ring_sends_2_n_minus_1_over_n_of_s_whatever_n():
    for n in (2, 4, 8, 256):
        assert messages_and_bytes("ring", 100.0, n) == (2 * (n - 1), pytest.approx(200 * (n - 1) / n))
        assert messages_and_bytes("naive", 100.0, n) == (n - 1, 100 * (n - 1))
    assert messages_and_bytes("ring", 100.0, 1) == (0, 0)


@chapter("ring_allreduce", "ddp_in_practice")
def test_predicted_times_order_the_algorithms_as_the_notebook_says():
    alpha, beta, size = 10e-6, 10e9, 102e6
    for n in (4, 8, 64):
        ring, tree, naive = (predicted_time(a, size, n, alpha, beta) for a in ("ring", "tree", "naive"))
        assert ring < tree < naive
        assert ring == pytest.approx(2 * (n - 1) * (alpha + size / (n * beta)))
        assert tree == pytest.approx(2 * math.ceil(math.log2(n)) * (alpha + size / beta))
    # tiny messages on many ranks: the tree's log N latency wins
    assert predicted_time("tree", 8, 1024, alpha, beta) < predicted_time("ring", 8, 1024, alpha, beta)


@chapter("ring_allreduce")
def test_fit_recovers_alpha_and_beta():
    sizes = [1e3, 1e5, 1e6, 4e6]
    alpha, beta = fit_alpha_beta(sizes, [50e-6 + s / 2e9 for s in sizes])
    assert alpha == pytest.approx(50e-6) and beta == pytest.approx(2e9)


@exercise("ring_all_reduce")
def test_time_all_reduces_times_each_function_and_checks_its_sum(capsys):
    timings = launch(time_all_reduces, 2, {"gloo": dist.all_reduce}, [4096], 2)[0]
    assert list(timings) == ["gloo"] and list(timings["gloo"]) == [4096] and timings["gloo"][4096] > 0
    print_bandwidth(timings, 2, baseline="gloo")
    assert "1.00x" in capsys.readouterr().out
    with pytest.raises(LaunchError, match="returned a wrong sum"):
        launch(time_all_reduces, 2, {"does nothing": lambda t: None}, [64], 1)
