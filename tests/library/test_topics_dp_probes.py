"""dpcourse.topics.data_parallel.probes:
probes catch replicas run in sequence, record threads, and misbehave on purpose.
"""

import threading

import pytest
import torch

from dpcourse.topics.data_parallel.probes import Fails, Keywords, ParallelProbe, TwoHeads, indexed_batch
from dpcourse.toys.models import mlp
from markers import exercise

pytestmark = exercise("mini_data_parallel")


def test_indexed_batch_holds_row_indices_in_column_zero():
    x = indexed_batch(5, features=3)
    assert x.shape == (5, 3) and x[:, 0].tolist() == [0, 1, 2, 3, 4]


def test_probe_fails_with_a_message_when_replicas_run_one_after_another():
    probe = ParallelProbe(mlp(4, 4, 1), parties=2, timeout=0.2)
    x = indexed_batch(4)
    with pytest.raises(AssertionError, match="did not run in parallel: the replica with rows \\[0, 1\\]"):
        probe(x[:2])


def test_probe_records_threads_rows_and_grad_mode():
    probe = ParallelProbe(mlp(4, 4, 1), parties=2, timeout=2)
    x = indexed_batch(4)
    threads = [threading.Thread(target=probe, args=(x[i:i + 2],)) for i in (0, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(c["rows"] for c in probe.calls) == [[0, 1], [2, 3]]
    assert len({c["thread"] for c in probe.calls}) == 2 and all(c["grad_enabled"] for c in probe.calls)
    probe.reset()
    assert probe.calls == []


def test_other_probes():
    x = indexed_batch(6)
    scores, (embedding, label) = TwoHeads()(x)
    assert scores.shape == (6, 3) and embedding.shape == (6, 8) and label == "label"
    k = Keywords()
    assert torch.allclose(k(x, scale=2.0, offset=torch.ones(6, 2)), 2 * k(x) + 1)
    with pytest.raises(ValueError, match="row 5 is corrupt"):
        Fails(bad_row=5)(x)
    assert Fails(bad_row=5)(x[:5]).shape == (5, 1)
