"""Notebook 11's hidden yardsticks are right, and its checks accept a correct implementation that is not
the notebook's solution.

The simulations in dpgrader.less_communication.checks are the reference of every hidden test, so each is
checked here against an independent computation where the method reduces to plain SGD (top-k with
k = n, PowerSGD with nothing worth compressing, local SGD with H = 1, asynchronous SGD with no delay:
reference.training replays them), and where it must differ from it. The tuned PowerSGD hook of the
benchmark (different split bookkeeping, flat memory, Gram-Schmidt instead of QR, state per layout)
passes the hidden check, and one with a planted mistake does not.
"""

import pytest
import torch

from dpcourse.reference.gradients import state_of
from dpcourse.reference.training import train_single_process
from dpcourse.topics.compression.data import TASK_MODEL, dyadic_gradients, task_data
from dpcourse.topics.compression.runs import build_model
from dpgrader.less_communication.checks import (
    check_powersgd_hook,
    simulate_async,
    simulate_local_sgd,
    simulate_powersgd,
    simulate_topk,
)
from dpgrader.less_communication.tuned import TunedPowerSGDState, tuned_powersgd_hook
from markers import exercise

pytestmark = pytest.mark.usefixtures("no_orphans")


def _max_difference(a, b):
    return max((a[name] - b[name]).abs().max().item() for name in b)


def _sgd(steps, per_rank, world_size, seed):
    X, Y = task_data(steps, per_rank, world_size, seed)
    net = train_single_process(build_model(TASK_MODEL, seed), X, Y, steps=steps,
                               global_size=per_rank * world_size)
    return state_of(net)


@exercise("topk_all_reduce")
def test_topk_simulation_sends_everything_when_k_is_n_and_keeps_what_it_did_not_send():
    grads = dyadic_gradients(2, 3, 10, seed=1)
    for _, residuals in simulate_topk(grads, 10):
        assert not any(r.any() for r in residuals)
    step0 = simulate_topk(grads, 10)[0][0]
    assert torch.equal(step0, (grads[0][0] + grads[1][0]) / 2)
    for step, (average, residuals) in enumerate(simulate_topk(grads, 3)):
        assert int((average != 0).sum()) <= 6
        if step == 0:
            for rank in range(2):
                assert int((residuals[rank] != 0).sum()) == 7
                assert torch.equal(residuals[rank] + (grads[rank][0] - residuals[rank]), grads[rank][0])


@exercise("topk_all_reduce")
def test_topk_simulation_without_error_feedback_forgets():
    grads = [[torch.tensor([3.0, 2.0, 0.5])] * 3]
    with_memory = [a for a, _ in simulate_topk(grads, 1)]
    without = [a for a, _ in simulate_topk(grads, 1, error_feedback=False)]
    assert all(torch.equal(a, torch.tensor([3.0, 0.0, 0.0])) for a in without)
    assert torch.equal(sum(with_memory), torch.tensor([9.0, 4.0, 0.0]))  # 2 + 2 sent at step 1


@exercise("powersgd_hook")
def test_powersgd_simulation_with_nothing_compressed_is_sgd():
    expected = _sgd(3, 4, 2, seed=0)
    got = simulate_powersgd(TASK_MODEL, 0, 3, 4, 2, matrix_rank=16)["state"]
    assert _max_difference(got, expected) < 1e-12
    compressed = simulate_powersgd(TASK_MODEL, 0, 3, 4, 2, matrix_rank=1)
    assert _max_difference(compressed["state"], expected) > 1e-6
    fc1 = compressed["grads"][0]["fc1.weight"]
    assert int(torch.linalg.matrix_rank(fc1)) == 1


@exercise("local_sgd")
def test_local_sgd_simulation_with_h1_is_sgd_and_drifts_otherwise():
    expected = _sgd(4, 2, 3, seed=2)
    for replica in simulate_local_sgd(TASK_MODEL, 2, 4, 2, 3, H=1):
        assert _max_difference(replica, expected) < 1e-12
    drifting = simulate_local_sgd(TASK_MODEL, 2, 4, 2, 3, H=3)
    assert _max_difference(drifting[0], drifting[1]) > 1e-6  # step 4 after the last average: apart
    assert _max_difference(simulate_local_sgd(TASK_MODEL, 2, 3, 2, 3, H=3)[1], expected) > 1e-6


@exercise("async_sgd")
def test_async_simulation_with_no_delay_is_sgd_and_a_delay_changes_it():
    expected = _sgd(5, 4, 1, seed=3)
    assert _max_difference(simulate_async(TASK_MODEL, 3, 5, 4, delay=0), expected) < 1e-12
    assert _max_difference(simulate_async(TASK_MODEL, 3, 5, 4, delay=2), expected) > 1e-6


@exercise("powersgd_hook")
def test_tuned_powersgd_hook_passes_the_hidden_check():
    check_powersgd_hook(tuned_powersgd_hook, TunedPowerSGDState)


class ForgetfulState(TunedPowerSGDState):
    """TunedPowerSGDState whose layouts forget each parameter's error when DDP rebuilds its buckets."""

    def layout(self, bucket):
        key = tuple(id(p) for p in bucket.parameters())
        if key not in self.layouts:
            self.errors = {}
        return super().layout(bucket)


@exercise("powersgd_hook")
def test_a_hook_that_loses_its_errors_at_the_bucket_rebuild_is_refused():
    with pytest.raises(AssertionError, match="the error ignores the previous one"):
        check_powersgd_hook(tuned_powersgd_hook, ForgetfulState)
