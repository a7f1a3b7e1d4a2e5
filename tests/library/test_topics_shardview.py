"""dpcourse.topics.data_parallel.shardview:
per-worker gradients of the line model, and the widget survives a broken function.
"""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from dpcourse.reference.gradients import full_batch_gradient  # noqa: E402
from dpcourse.topics.data_parallel.shardview import plot_shard_gradients, shard_explorer, shard_gradients  # noqa: E402
from dpcourse.toys.data import line_data
from dpcourse.toys.models import linear  # noqa: E402
from markers import exercise  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:FigureCanvasAgg is non-interactive"),
              *exercise("shard_indices")]


def test_weighted_mean_of_shard_gradients_is_the_full_batch_gradient():
    x, y = line_data(10, seed=0)
    model = linear(1, 1, seed=0)
    shards = list(torch.tensor_split(torch.arange(10), 4)) + [torch.tensor([], dtype=torch.long)]
    sizes, grads = shard_gradients(shards, x, y, model)
    assert sizes == [3, 3, 2, 2, 0] and grads[-1] is None
    # the yardstick is independent of shard_gradients: autograd on the whole batch, in float64
    full = torch.stack([g.flatten()[0] for g in full_batch_gradient(model, nn.MSELoss(), x, y)]).float()
    weighted = sum(s * g for s, g in zip(sizes[:4], grads[:4], strict=True)) / 10
    assert torch.allclose(weighted, full, atol=1e-6)


def test_plot_marks_unused_and_doubled_samples():
    x, y = line_data(6, seed=1)
    fig = plot_shard_gradients([[0, 1, 2], [3, 0]], x, y, linear(1, 1))
    assert len(fig.axes) == 2
    plt.close("all")


def test_explorer_shows_the_learners_error_instead_of_raising(capsys):
    def not_written(n, rank, world_size, remainder="spread"):
        raise NotImplementedError()

    shard_explorer(not_written)
    assert "shard_indices raised NotImplementedError" in capsys.readouterr().out
    plt.close("all")
