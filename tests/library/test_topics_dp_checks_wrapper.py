"""dpcourse.topics.data_parallel.checks: a wrapper is compared with its module, and each kind of
mismatch is named."""

from functools import partial

import pytest
import torch
from torch import nn

from dpcourse.topics.data_parallel.checks import (
    expect_like_module,
    expect_like_module_results,
    expect_same_structure,
    like_module_run,
    row_order_hint,
    run_like_modules,
)
from dpcourse.topics.data_parallel.probes import Fails, ParallelProbe, TwoHeads, indexed_batch
from dpcourse.toys.models import mlp
from markers import exercise

pytestmark = exercise("mini_data_parallel")


class Halves(nn.Module):
    """Calls the module on the two halves of the batch, in one thread (right or deliberately wrong)."""

    def __init__(self, module, devices, mistake=None):
        super().__init__()
        self.devices = devices
        self.module, self.mistake = module, mistake

    def forward(self, x):
        k = len(x) // 2
        outs = [self.module(x[:k]), self.module(x[k:])]
        if self.mistake == "swap":
            outs.reverse()
        if self.mistake == "detach":
            outs = [o.detach() for o in outs]
        if self.mistake == "raise":
            raise RuntimeError("boom")
        if isinstance(outs[0], tuple):
            return torch.cat([outs[0][0], outs[1][0]]), (torch.cat([outs[0][1][0], outs[1][1][0]]), "label")
        return torch.cat(outs)


def test_a_correct_wrapper_passes_even_with_tuple_outputs():
    model = mlp(4, 8, 2)
    run = expect_like_module(Halves, model, ["cpu"], (indexed_batch(6),), what="halves", wrap=ParallelProbe)
    assert sorted(c["rows"] for c in run["calls"]) == [[0, 1, 2], [3, 4, 5]]
    heads = TwoHeads()
    expect_like_module(Halves, heads, ["cpu"], (indexed_batch(6),), what="halves")


def test_the_run_is_plain_and_errors_come_back_as_text():
    """What a rank returns: plain values only, the learner's exception as [type, message]."""
    run = like_module_run(Halves, TwoHeads(), ["cpu"], (indexed_batch(4),))
    assert run["error"] is None and run["requires_grad"] and run["devices"] == ["cpu", "cpu"]
    assert run["output"][1][1] == "label" and not run["output"][0].requires_grad
    assert all(isinstance(g, torch.Tensor) for g in run["grads"])
    failed = like_module_run(Halves, Fails(bad_row=1), ["cpu"], (indexed_batch(4),))
    assert failed["error"] == ["ValueError", "row 1 is corrupt"]
    no_grad = like_module_run(Halves, mlp(4, 8, 2), ["cpu"], (indexed_batch(4),), no_grad=True,
                              wrap=ParallelProbe)
    assert not no_grad["requires_grad"] and not any(c["grad_enabled"] for c in no_grad["calls"])


def test_several_cases_in_one_launch_and_a_probe_diagnosis_is_kept():
    model = mlp(4, 8, 2)
    runs = run_like_modules(Halves, [dict(module=model, devices=["cpu"], args=(indexed_batch(6),)),
                                     dict(module=model, devices=["cpu"], args=(indexed_batch(6),),
                                          wrap=partial(ParallelProbe, parties=2, timeout=0.2))])
    expect_like_module_results(runs[0], model, (indexed_batch(6),), what="halves")
    with pytest.raises(AssertionError, match="^the replicas did not run in parallel"):
        expect_like_module_results(runs[1], model, (indexed_batch(6),), what="halves")


@pytest.mark.parametrize("mistake, message", [
    ("swap", r"its rows are rows \[3, 4, 5, 0, 1, 2\] of the expected output"),
    ("detach", "does not require grad"),
    ("raise", "halves raised RuntimeError: boom"),
])
def test_each_mistake_is_named(mistake, message):
    model = mlp(4, 8, 2)
    with pytest.raises(AssertionError, match=message):
        expect_like_module(Halves, model, ["cpu"], (indexed_batch(6),), what="halves",
                           wrapper_kwargs=dict(mistake=mistake))


@exercise("scatter")
def test_structures_types_devices_and_objects():
    x = torch.arange(6.0).reshape(3, 2)
    marker = object()
    expect_same_structure([(x, {"k": marker})], [(x.clone(), {"k": marker})], "s")
    with pytest.raises(AssertionError, match=r"s, \[0\] should be a tuple, got a list"):
        expect_same_structure([[x]], [(x,)], "s")
    with pytest.raises(AssertionError, match=r"\['k'\] is None, expected 0.5"):
        expect_same_structure({"k": None}, {"k": 0.5}, "s")
    with pytest.raises(AssertionError, match="has keys"):
        expect_same_structure({"a": 1}, {"b": 1}, "s")
    with pytest.raises(AssertionError, match="is on cpu, expected meta"):
        expect_same_structure(x, x, "s", devices="meta")
    with pytest.raises(AssertionError, match="should be a tensor"):
        expect_same_structure(1.0, x, "s")


@exercise("scatter")
def test_row_order_hint_only_for_permutations():
    e = torch.arange(8.0).reshape(4, 2)
    assert "rows [1, 0, 2, 3]" in row_order_hint(e[[1, 0, 2, 3]], e)
    assert row_order_hint(e + 1, e) == ""
