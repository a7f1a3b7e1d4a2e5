"""dpcourse.topics.data_parallel.timeline:
one iteration through a threaded wrapper is split into phases and lanes.
"""

import threading

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from dpcourse.topics.data_parallel.probes import indexed_batch  # noqa: E402
from dpcourse.topics.data_parallel.replicas import cpu_devices, replicate  # noqa: E402
from dpcourse.topics.data_parallel.timeline import (  # noqa: E402
    PHASES,
    describe_phase,
    phase_explorer,
    plot_timeline,
    record_iteration,
)
from dpcourse.toys.models import mlp  # noqa: E402
from markers import exercise  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:FigureCanvasAgg is non-interactive"),
              *exercise("mini_data_parallel")]


class Threaded(nn.Module):
    """A minimal threaded wrapper (tensor inputs and outputs only) to time."""

    def __init__(self, module, n):
        super().__init__()
        self.module, self.n = module, n

    def forward(self, x):
        pieces = torch.tensor_split(x, self.n)
        replicas = replicate(self.module, cpu_devices(self.n))
        outs = [None] * self.n

        def run(i):
            outs[i] = replicas[i](pieces[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return torch.cat(outs)


def test_iteration_has_every_phase_and_one_lane_per_replica():
    model = mlp(4, 16, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    timeline = record_iteration(Threaded(model, 3), nn.MSELoss(), indexed_batch(12), torch.zeros(12, 2),
                                optimizer)
    phases = {e.phase for e in timeline.events}
    assert {"scatter", "replicate", "forward", "gather", "loss", "backward", "reduce", "step"} <= phases
    assert timeline.replicas == 3
    assert sorted(e.lane for e in timeline.events if e.phase == "forward") == [
        "replica 0", "replica 1", "replica 2"]
    assert sum(e.phase == "reduce" for e in timeline.events) == 4  # one tick per parameter
    assert all(e.end >= e.start >= 0 for e in timeline.events)
    for phase in PHASES:
        assert phase in describe_phase(timeline, phase, {"replicate": 7e8})
    assert "700.0 MB" in describe_phase(timeline, "replicate", {"replicate": 7e8})
    plot_timeline(timeline, upto="gather")
    phase_explorer(timeline)
    plt.close("all")


def test_nn_dataparallel_on_cpu_is_one_pass_through_replica():
    model = mlp(4, 8, 1)
    timeline = record_iteration(nn.DataParallel(model), nn.MSELoss(), indexed_batch(6), torch.zeros(6, 1))
    assert timeline.replicas == 1 and not any(e.phase == "replicate" for e in timeline.events)
