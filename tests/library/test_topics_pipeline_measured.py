"""pipeline.measured: what one micro-batch keeps on each stage of the measured model (KEPT), counted
independently with autograd's saved-tensor hooks.

That the measurement tells a 1F1B step from one that keeps a copy of every output is shown by the
planted bug a_copy_of_every_output_kept (autograder/dpgrader/pipeline_parallelism/bugs.py), judged
by tests/grader/test_grading.py."""

import pytest
import torch

from dpcourse.topics.pipeline import measured
from dpcourse.topics.pipeline.stages import make_stage
from markers import exercise


@exercise("run_schedule")
@pytest.mark.parametrize("index", range(measured.STAGES))
def test_kept_counts_what_autograd_saves_for_one_micro_batch(index):
    stage = make_stage(measured.memory_model(), measured.CUTS, index, device="cpu")
    batch, _ = measured.memory_data("cpu")
    x = batch[:measured.ROWS] if index == 0 else torch.randn(
        measured.ROWS, stage.in_features, dtype=torch.float64, requires_grad=True)
    storages = {}

    def keep(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = stage.module(x)
    for held_before in (batch, *stage.module.parameters()):  # held before the step: not the micro-batch's
        storages.pop(held_before.untyped_storage().data_ptr(), None)
    storages[out.untyped_storage().data_ptr()] = out.untyped_storage().nbytes()  # kept until its backward
    large = [n for n in storages.values() if n >= measured.ACTIVATION]
    assert len(large) == measured.KEPT[index] and all(n == measured.ACTIVATION for n in large), storages
    assert sum(storages.values()) - sum(large) < measured.ACTIVATION // 8, storages

