"""dpcourse.topics.compression.runs: what the ranks return to notebook 11's tests, and the two demos'
measurements (DDP's bucket rebuild, torch's PeriodicModelAverager)."""

import pytest
import torch
import torch.distributed as dist

from dpcourse import launch
from dpcourse.topics.compression.data import TASK_MODEL, dyadic_gradients
from dpcourse.topics.compression.runs import (
    async_run,
    averager_steps,
    bucket_orders,
    launch_run,
    local_sgd_run,
    powersgd_run,
    topk_run,
)
from markers import exercise

pytestmark = pytest.mark.usefixtures("no_orphans")


def dense_mean(grad, residual, k):
    """Not top-k at all: the mean of the gradients, an all-reduce, residual zero (a stand-in)."""
    total = grad + residual
    dist.all_reduce(total)
    return total / dist.get_world_size(), torch.zeros_like(grad)


@exercise("topk_all_reduce")
def test_topk_run_returns_each_step_and_the_calls():
    grads = dyadic_gradients(2, 3, 5, seed=0)
    results = launch_run(topk_run, 2, dense_mean, grads, 2)
    for result in results:
        assert len(result["averages"]) == len(result["residuals"]) == 3
        assert torch.equal(result["averages"][1], (grads[0][1] + grads[1][1]) / 2)
        assert [(o.op, o.nbytes) for o in result["ops"]] == [("all_reduce", 40)] * 3


def unwritten(grad, residual, k):
    raise NotImplementedError()


@exercise("topk_all_reduce", "powersgd_hook", "local_sgd", "async_sgd")
def test_launch_run_names_the_learner_function_that_failed():
    with pytest.raises(AssertionError, match="unwritten on 2 rank"):
        launch_run(topk_run, 2, unwritten, dyadic_gradients(2, 1, 4), 1)


class NoState:
    def __init__(self, matrix_rank):
        self.errors = {}


def allreduce_hook(state, bucket):
    world_size = dist.get_world_size()
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(
        lambda fut: fut.value()[0] / world_size)


@exercise("powersgd_hook")
def test_powersgd_run_reports_applied_and_local_gradients():
    results = launch_run(powersgd_run, 2, allreduce_hook, NoState, 1, TASK_MODEL, 0, 2, 2)
    for result in results:
        assert len(result["grads"]) == len(result["local"]) == len(result["errors_by_step"]) == 2
        assert all(v is None for v in result["errors_by_step"][0].values())
        assert {o.op for o in result["ops"]} <= {"all_reduce", "broadcast"}
    mean = (results[0]["local"][0]["fc0.weight"] + results[1]["local"][0]["fc0.weight"]) / 2
    assert torch.allclose(results[0]["grads"][0]["fc0.weight"], mean, atol=1e-15)


def plain_sgd_then_average(model, batches, lr, H):
    for x, y in batches:
        model.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    dist.all_reduce(flat)


@exercise("local_sgd")
def test_local_sgd_run_gives_each_rank_its_share():
    results = launch_run(local_sgd_run, 2, plain_sgd_then_average, TASK_MODEL, 0, 3, 2, 3)
    assert not torch.equal(results[0]["state"]["fc0.weight"], results[1]["state"]["fc0.weight"])
    assert [(o.op, o.nbytes) for o in results[0]["ops"]] == [("all_reduce", 3600)]


def pings(model, batches, lr, delay):
    flat = torch.zeros(len(batches))
    if dist.get_rank() == 0:
        dist.send(flat, 1)
    else:
        dist.recv(flat, 0)


@exercise("async_sgd")
def test_async_run_hands_every_rank_the_whole_schedule():
    results = launch_run(async_run, 2, pings, TASK_MODEL, 0, 5, 4, 1)
    assert [(o.op, o.nbytes) for o in results[0]["ops"]] == [("send", 20)]
    assert [o.op for o in results[1]["ops"]] == ["recv"]


@exercise("powersgd_hook")
def test_ddp_rebuilds_its_buckets_after_the_first_step():
    seen = launch(bucket_orders, 2, TASK_MODEL)[0]   # a demo's helper: every rank the same arguments
    first = [names for step, _, names in seen if step == 0][0]
    later = [names for step, _, names in seen if step == 1][0]
    assert first[0] == "fc0.weight" and later[0] == "head.bias" and sorted(first) == sorted(later)


@exercise("local_sgd")
def test_periodic_model_averager_averages_after_steps_1_then_every_period():
    assert launch(averager_steps, 2, 3, 7, TASK_MODEL)[0]["averaged_after"] == [1, 4, 7]
