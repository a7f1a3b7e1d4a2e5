"""dpcourse.topics.sequence.measure: peak memory, saved activations and FLOPs, measured in one process."""

import torch
from torch import nn

from dpcourse.topics.sequence.measure import LayerNormBytes, PeakMemory, StepRecorder
from markers import exercise

pytestmark = exercise("sequence_parallel_mlp", "ring_attention")


def test_peak_memory_counts_what_is_created_once_per_storage_and_forgets_what_is_freed():
    x = torch.zeros(1000, dtype=torch.float64)  # an input: not counted
    with PeakMemory() as peak:
        a = x + 1  # 8000 bytes
        view = a[:10]  # the same storage: nothing more
        del a, view
        b = x * 2  # the first one is gone: still 8000 at most
        c = torch.cat((b, b))  # 16000 more, while b lives
        a_sum = c.sum()
    assert peak.peak_bytes == 8000 + 16000 + a_sum.element_size()
    assert peak.most_alive[8000] == 1 and peak.most_alive[16000] == 1  # a's storage, then b's; then c's


def test_peak_memory_counts_the_most_tensors_of_one_size_alive_at_once():
    x = torch.zeros(100, dtype=torch.float64)
    with PeakMemory() as peak:
        kept = [x + i for i in range(3)]  # three of 800 bytes at once
        del kept
        for i in range(5):
            y = x + i  # one at a time: the previous is freed when y is rebound
        del y
    assert peak.most_alive[800] == 3


def test_a_layer_norm_keeps_its_input_and_statistics_however_it_is_called():
    norm = nn.LayerNorm(8).double()
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    with LayerNormBytes() as saved:
        norm(x)
    # the input (6 x 8) and the mean and reciprocal standard deviation (6 each), not the parameters
    assert saved.nbytes == (6 * 8 + 6 + 6) * 8
    with LayerNormBytes() as half:
        torch.nn.functional.layer_norm(x[:3], (8,), norm.weight, norm.bias)
    assert half.nbytes * 2 == saved.nbytes


def test_the_step_recorder_counts_matrix_product_flops():
    a, b = torch.randn(4, 5), torch.randn(5, 6)
    with StepRecorder() as rec:
        a @ b
        torch.bmm(a.unsqueeze(0), b.unsqueeze(0))
    assert rec.total_flops == 2 * (2 * 4 * 5 * 6)
