"""dpcourse.topics.compression.curves and pictures: every method on the same task, loss against bytes."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dpcourse.topics.compression.curves import (  # noqa: E402
    DEMO_MODEL,
    compare_methods,
    plot_loss_vs_bytes,
    summary_rows,
)
from dpcourse.topics.compression.pictures import plot_sent, relative_error, updated_coordinates  # noqa: E402
from dpcourse.topics.compression.runs import build_model  # noqa: E402
from markers import exercise  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_orphans")


def averaged_every_h(model, batches, lr, H):
    """A local SGD good enough for the curves: plain SGD, then one all-reduce of all parameters."""
    for x, y in batches:
        model.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    with torch.no_grad():
        flat = torch.cat([p.reshape(-1) for p in model.parameters()])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        offset = 0
        for p in model.parameters():
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


@exercise("powersgd_hook", "async_sgd")
def test_full_all_reduce_and_local_sgd_on_the_same_task():
    methods = {"full": ("all_reduce", None, {}), "local H = 2": ("local_sgd", averaged_every_h, {"H": 2})}
    curves = compare_methods(methods, world_size=2, steps=4, per_rank=4)
    gradient_bytes = sum(p.numel() * p.element_size() for p in build_model(DEMO_MODEL, 0).parameters())
    full, local = curves["full"], curves["local H = 2"]
    assert len(full) == 5 and len(local) == 3  # the start, then every step / every block of H
    assert full[-1][0] == pytest.approx(4 * 2 * gradient_bytes)  # 4 steps x 2 ranks x 2(N-1)/N·S
    assert local[-1][0] == pytest.approx(full[-1][0] / 2)
    assert full[-1][1] < full[0][1] and full[0][1] == local[0][1]
    assert [row[0] for row in summary_rows(curves)] == ["full", "local H = 2"]
    plot_loss_vs_bytes(curves, methods, steps=4)


@exercise("topk_all_reduce")
def test_sent_coordinates_and_the_error_of_the_summed_updates():
    averages = [torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 0.0, 2.0])]
    assert updated_coordinates(averages) == 2
    assert relative_error(averages, torch.tensor([1.0, 0.0, 2.0])) == 0.0
    assert relative_error(averages, torch.tensor([1.0, 2.0, 2.0])) == pytest.approx(2 / 3)
    plot_sent({"a": averages, "b": averages})
