"""topics.zero.runs and pictures: the scaffolding's gradient is DDP's average, failures read well,
and the pictures draw from real logs."""

import matplotlib
import pytest
import torch

from dpcourse.reference.gradients import single_process_gradients
from dpcourse.topics.zero.memory import STAGES, implementation_bytes
from dpcourse.topics.zero.pictures import plot_memory, plot_unit_timeline
from dpcourse.topics.zero.runs import explain_crash, global_gradient, launch_run, model_label, zero1_run
from dpcourse.topics.zero.units import FlatUnit, UnitRecorder
from dpcourse.toys.data import my_share, smooth_regression_data
from dpcourse.toys.models import deep_mlp
from markers import exercise

matplotlib.use("Agg")


@exercise("sharded_optimizer", "reduce_scatter_gradients")
def test_the_global_gradient_is_the_average_of_the_shard_gradients():
    X, Y = smooth_regression_data(12, seed=5)
    model = deep_mlp(seed=1)
    global_gradient(model, X, Y)
    shards = [single_process_gradients(deep_mlp(seed=1), *my_share(X, Y, 0, 4, r, 3, "cpu"))
              for r in range(3)]
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, sum(s[name] for s in shards) / 3, atol=1e-15)


class Unwritten:
    def __init__(self, params, optimizer_cls, **kwargs):
        raise NotImplementedError()


@exercise("sharded_optimizer", "reduce_scatter_gradients", "mini_fsdp")
def test_a_failing_run_names_the_class_and_a_freed_unit_gets_its_explanation():
    with pytest.raises(AssertionError, match="Unwritten on 2 rank.s.: rank . of 2 raised NotImplemented"):
        launch_run(zero1_run, 2, Unwritten, "deep_mlp", 0, 1, 2)
    assert "Gather a unit" in explain_crash("RuntimeError: ... out of bounds for storage of size 0")
    assert explain_crash("RuntimeError: something else") == ""
    wrong_unit = explain_crash("RuntimeError: ... of size 0 [not gathered: fc0; gathered before it: head]")
    assert "fc0 ran its forward while freed, and the unit gathered just before it was head" in wrong_unit
    assert "default arguments" in wrong_unit
    assert "Gather a unit" in explain_crash("RuntimeError: ... [not gathered: fc0; gathered before it: None]")
    assert model_label(("deep_mlp", {"width": 5})) == "deep_mlp(width=5)"


@exercise("mini_fsdp")
def test_pictures_draw():
    plot_memory({s: implementation_bytes(994, 4, s) for s in STAGES},
                {s: implementation_bytes(994, 4, s) for s in STAGES})
    model = deep_mlp(seed=0)
    with UnitRecorder() as log:
        unit = FlatUnit(model.fc0, "fc0")
        unit.free()
        log.mark("built")
        unit.alloc()
        unit.free()
        FlatUnit(model.fc1, "fc1")  # never freed: drawn hatched
    plot_unit_timeline(log.events, title="two units")
    matplotlib.pyplot.close("all")
