"""dpcourse.topics.hybrid.pipeline: the GPipe step built from differentiable send and receive
equals one process on the whole batch (loss and every gradient), for 1 to 4 stages, a stage of no
parameters, and m = 1 .. 4; its messages are notebook 07's: one activation and one gradient per
micro-batch and neighbour."""

import pytest
import torch
import torch.distributed as dist

from dpcourse import launch
from dpcourse.comm.recorder import CommRecorder
from dpcourse.topics.hybrid.models import dp_pp_model, even_cuts
from dpcourse.topics.hybrid.pipeline import gpipe
from dpcourse.topics.pipeline.stages import make_stage
from dpcourse.topics.tensor.models import inputs
from dpcourse.toys.models import loss_fn
from markers import exercise

pytestmark = exercise("hybrid_dp_pp_step")


def one_step(cuts, n_micro, x, y):
    stage = make_stage(dp_pp_model(width=5, layers=4, seed=0), cuts, dist.get_rank())
    with CommRecorder() as rec:
        loss = gpipe(stage, x, y, loss_fn, n_micro)
    grads = {n: p.grad.clone() for n, p in stage.module.named_parameters()}
    return loss, grads, [(o.op, o.nbytes, o.world_peer) for o in rec.ops]


@pytest.mark.parametrize("cuts, n_micro", [([0, 7], 2), ([0, 4, 7], 1), ([0, 4, 7], 4), ([0, 2, 3, 4, 7], 2),
                                           ([0, 1, 2, 7], 3)])
def test_gpipe_equals_one_process(cuts, n_micro):
    x, y = inputs((12, 5), seed=1), inputs((12, 5), seed=2)
    model = dp_pp_model(width=5, layers=4, seed=0)
    loss = loss_fn(model(x), y)
    loss.backward()
    reference = {n: p.grad for n, p in model.named_parameters()}
    results = launch(one_step, len(cuts) - 1, cuts, n_micro, x, y)
    assert results[-1][0] == pytest.approx(loss.item(), rel=1e-12)
    assert all(r[0] is None for r in results[:-1])
    for stage, (_, grads, ops) in enumerate(results):
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference[name], rtol=1e-12, atol=1e-14)
        rows = 12 // n_micro
        sends = [o for o in ops if o[0] == "send"]
        expected = n_micro * ((stage < len(cuts) - 2) + (stage > 0))
        assert len(sends) == expected and all(o[1] == rows * 5 * 8 for o in sends)


def test_gpipe_refuses_a_batch_that_does_not_split():
    def step():
        stage = make_stage(dp_pp_model(width=5, layers=2, seed=0), [0, 3], 0)
        try:
            gpipe(stage, inputs((5, 5), seed=1), inputs((5, 5), seed=2), loss_fn, 2)
        except ValueError as error:
            return str(error)
    assert "does not split into 2 equal micro-batches" in launch(step, 1)[0]


def test_even_cuts_keep_linear_tanh_pairs():
    assert even_cuts(7, 2) == [0, 4, 7]
    assert even_cuts(15, 4) == [0, 4, 8, 12, 15]
    with pytest.raises(ValueError):
        even_cuts(7, 3)
