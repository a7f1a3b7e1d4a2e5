"""Hidden checks of 01_first_principles. Each raises a short AssertionError saying what is wrong.

Expected values never come from the learner's functions: index arithmetic done
another way (tensor_split, reshape), single-process float64 training on the
whole batch (dpcourse.reference.gradients), and the ZeRO paper's model-state
formulas (dpcourse.topics.zero.memory.model_state_bytes).
"""

import copy

import torch
import torch.distributed as dist
from torch import nn

from dpcourse import launch, rank_device
from dpcourse.checks.core import describe, expect_close, known_mistake
from dpcourse.checks.params import (
    expect_gradients,
    expect_parameters,
    expect_replicas_equal,
    expect_shard_calls,
)
from dpcourse.reference.gradients import batch_norm, full_batch_gradient, parameter_names, sgd_steps
from dpcourse.reference.memory import model_state_bytes
from dpcourse.reference.mistakes import batch_norm_mistakes, gradient_mistakes
from dpcourse.reference.splits import ceil_div, chunk_sizes
from dpcourse.runtime.timeouts import TIMEOUTS
from dpcourse.topics.data_parallel.checks import expect_memory
from dpcourse.toys.data import gradient_problems, line_data
from dpcourse.toys.models import RecordingLoss, linear

# What each exercise's expected values come from (autograder/exercises.json lists them).
REFERENCES = {
    "shard_indices": "torch.tensor_split and reshape of arange(n), one per remainder policy",
    "data_parallel_gradient": "the float64 gradient of the whole batch in one process "
                              "(dpcourse.reference.gradients.full_batch_gradient); diagnoses from known "
                              "wrong answers computed from the shards (dpcourse.reference.mistakes)",
    "simulated_dp_step": "plain SGD on the whole batch in float64 (dpcourse.reference.gradients.sgd_steps)",
    "allreduce_sgd_step": "plain SGD on the whole batch in float64 (dpcourse.reference.gradients.sgd_steps)",
    "sync_batch_norm": "batch normalisation of every rank's rows together, in float64 "
                       "(dpcourse.reference.gradients.batch_norm)",
    "memory_per_gpu": "the ZeRO paper's model states, 2Ψ + 2Ψ + KΨ in mixed precision (§ 3.1; "
                      "dpcourse.topics.zero.memory.model_state_bytes, stage DDP), with K = 4 (fp32 master "
                      "copy) + 4 per optimizer moment, and the activations of the largest shard of "
                      "tensor_split (dpcourse.reference.splits.chunk_sizes)",
}


def expected_shards(n, world, remainder):
    """Rank by rank, the indices each policy gives, computed by tensor_split and reshape."""
    if remainder == "spread":
        return list(torch.tensor_split(torch.arange(n), world))
    if remainder == "drop":
        per = n // world
        return list(torch.arange(per * world).reshape(world, per))
    if remainder == "pad":
        per = ceil_div(n, world)
        return list((torch.arange(per * world) % max(n, 1)).reshape(world, per))
    raise ValueError(remainder)


# ----------------------------------------------------------------------------------------------
# exercise 1

def check_shard_indices(shard_indices):
    cases = [(n, world, remainder) for remainder in ("spread", "drop", "pad")
             for n, world in [(10, 4), (7, 3), (13, 5), (5, 1), (3, 4), (12, 4), (100, 7), (1, 3)]]
    cases += [(0, 3, "spread"), (0, 2, "drop")]
    for n, world, remainder in cases:
        expected = expected_shards(n, world, remainder)
        got = [shard_indices(n, rank, world, remainder) for rank in range(world)]
        call = f"shard_indices({n}, rank, {world}, {remainder!r})"
        for rank, g in enumerate(got):
            if not isinstance(g, torch.Tensor) or g.dtype != torch.long or g.dim() != 1:
                raise AssertionError(f"rank {rank}: {call} should be a 1-D torch.long tensor, got "
                                     f"{describe(g)}")
        sizes, want = [len(g) for g in got], [len(e) for e in expected]
        if sizes != want:
            raise AssertionError(f"{call} gives shard sizes {sizes} for ranks 0..{world - 1}, "
                                 f"expected {want}")
        for rank, (g, e) in enumerate(zip(got, expected, strict=True)):
            if not torch.equal(g, e):
                raise AssertionError(f"rank {rank}: shard_indices({n}, {rank}, {world}, {remainder!r}) "
                                     f"is {describe(g, 12)}, expected {describe(e, 12)}")


# ----------------------------------------------------------------------------------------------
# exercise 2

def check_data_parallel_gradient(data_parallel_gradient):
    for seed in (0, 1):
        for name, model, loss_fn, x, y in gradient_problems(seed):
            for world in (1, 3, 4, len(x) + 2):
                if seed:  # stale gradients left by an earlier backward must not leak in
                    for p in model.parameters():
                        p.grad = torch.full_like(p, 7.0)
                case = f"{name}, {len(x)} samples over {world} workers" + (
                    " (the model arrives with stale .grad from an earlier step)" if seed else "")
                expected = full_batch_gradient(model, loss_fn, x, y)
                recording = RecordingLoss(loss_fn)
                got = data_parallel_gradient(model, recording, x, y, world)
                expect_shard_calls(recording.sizes, chunk_sizes(len(x), world), f"with {case}")
                stale = [torch.full_like(p, 7.0) for p in model.parameters()] if seed else None
                expect_gradients(got, expected, parameter_names(model), f"with {case}",
                                 suspects=gradient_mistakes(model, loss_fn, x, y, world, stale=stale))


# ----------------------------------------------------------------------------------------------
# exercise 3

def check_simulated_dp_step(simulated_dp_step, lr=0.1, steps=2):
    for seed in (0, 1):
        for name, model, loss_fn, x, y in gradient_problems(seed):
            for workers in (1, 3, 4):
                case = f"{name}, {len(x)} samples over {workers} workers"
                start = [p.detach().double().clone() for p in model.parameters()]
                expected = sgd_steps(model, loss_fn, x, y, lr, steps)
                names = parameter_names(model)
                replicas = [copy.deepcopy(model) for _ in range(workers)]
                recording = RecordingLoss(loss_fn)
                for _ in range(steps):
                    simulated_dp_step(replicas, recording, x, y, lr)
                expect_shard_calls(recording.sizes, chunk_sizes(len(x), workers) * steps,
                                   f"with {case}, in {steps} steps")
                expect_replicas_equal(replicas, names, f"with {case}, after {steps} steps")
                expect_parameters(replicas[0].parameters(), expected, names, start,
                                  f"with {case}: after {steps} SGD steps (lr={lr}), replica 0")


# ----------------------------------------------------------------------------------------------
# exercise 4

def run_allreduce_steps(step, problems, lr, steps):
    """On each rank: train every problem's model `steps` steps with the learner's step function."""
    device, out = rank_device(), []
    for model, loss_fn, x, y in problems:
        model = copy.deepcopy(model).to(device)
        recording = RecordingLoss(loss_fn)
        for _ in range(steps):
            step(model, recording, x.to(device), y.to(device), lr)
        out.append(([p.detach().cpu() for p in model.parameters()], recording.sizes))
    return out


def check_allreduce_sgd_step(allreduce_sgd_step, lr=0.1, steps=2):
    named = [(name, (model, loss_fn, x, y)) for name, model, loss_fn, x, y in gradient_problems(0)]
    few = ("a line fit with 2 samples (some ranks get none)",
           (linear(1, 1, seed=5), nn.MSELoss(), *line_data(2, seed=5)))
    for world in (1, 3, 4):
        cases = named + ([few] if world > 2 else [])
        results = launch(run_allreduce_steps, world, allreduce_sgd_step, [p for _, p in cases], lr, steps,
                         group_timeout=TIMEOUTS["test_group"])
        for index, (name, (model, loss_fn, x, y)) in enumerate(cases):
            start = [p.detach().double().clone() for p in model.parameters()]
            expected = sgd_steps(model, loss_fn, x, y, lr, steps)
            sizes = chunk_sizes(len(x), world)
            for rank in range(world):
                params, seen = results[rank][index]
                what = f"rank {rank}: with {name} over {world} ranks"
                expect_shard_calls(seen, [sizes[rank]] * steps, f"{what}, in {steps} steps")
                expect_parameters(params, expected, parameter_names(model), start,
                                  f"{what}, after {steps} steps")


# ----------------------------------------------------------------------------------------------
# exercise 5

def run_sync_batch_norm(fn, shards, weight, bias, eps):
    device = rank_device()
    x = shards[dist.get_rank()].to(device)
    before = x.clone()
    with torch.no_grad():
        out = fn(x, weight.to(device), bias.to(device), eps)
    return out, torch.equal(x, before)


def check_sync_batch_norm(sync_batch_norm):
    g = torch.Generator().manual_seed(11)
    cases = {
        "shards of 5, 1 and 3 samples": [torch.randn(n, 4, generator=g) * 3 + 1 for n in (5, 1, 3)],
        "channels with a large mean (1000 + N(0, 1)): accumulate in float64":
            [torch.randn(n, 3, generator=g) + 1000 for n in (4, 2, 6)],
        "an empty shard on rank 1": [torch.randn(4, 2, generator=g), torch.zeros(0, 2)],
        "a single rank": [torch.randn(6, 3, generator=g) * 2],
        "shards with very different means": [torch.randn(3, 2, generator=g) + shift
                                             for shift in (-5.0, 0.0, 5.0, 10.0)],
    }
    for name, shards in cases.items():
        channels = shards[0].shape[1]
        weight, bias = torch.linspace(0.5, 2.0, channels), torch.linspace(-1.0, 1.0, channels)
        expected = torch.split(batch_norm(torch.cat(shards), weight, bias), [len(s) for s in shards])
        results = launch(run_sync_batch_norm, len(shards), sync_batch_norm, shards, weight, bias, 1e-5,
                         group_timeout=TIMEOUTS["test_group"])
        hint = known_mistake([out for out, _ in results], batch_norm_mistakes(shards, weight, bias))
        for rank, ((out, unchanged), want) in enumerate(zip(results, expected, strict=True)):
            what = f"rank {rank}: sync_batch_norm with {name}"
            expect_close(out, want, what, hint=hint)
            if out.dtype != shards[rank].dtype:
                raise AssertionError(f"{what} returned dtype {out.dtype}, expected the input's "
                                     f"{shards[rank].dtype}")
            if not unchanged:
                raise AssertionError(f"{what} modified its input x in place")


# ----------------------------------------------------------------------------------------------
# exercise 6

MOMENTS = {"sgd": 0, "momentum": 1, "adam": 2}  # fp32 tensors the optimizer keeps per parameter


def expected_memory(n_params, optimizer, mixed_precision, world_size, global_batch, per_sample):
    """(bytes per part, why per part) for one data-parallel GPU, from the ZeRO paper's formulas."""
    weight_bytes = 2 if mixed_precision else 4
    master = 4 if mixed_precision else 0
    k = master + 4 * MOMENTS[optimizer]
    states = model_state_bytes(n_params, 1, "DDP", weight_bytes=weight_bytes, grad_bytes=weight_bytes,
                               K=k)
    largest_shard = max(chunk_sizes(global_batch, world_size))
    expected = dict(states, activations=largest_shard * per_sample)
    expected["total"] = sum(expected.values())
    precision = "fp16" if mixed_precision else "fp32"
    parts = ([f"fp32 master weights {master}"] if master else []) + [
        f"{name} {4}" for name in ("momentum", "variance")[:MOMENTS[optimizer]]]
    whole = f", on every rank whatever the world size ({world_size}): data parallelism replicates the model"
    why = {
        "weights": f"{precision} weights, {weight_bytes} bytes each{whole}",
        "gradients": f"{precision} gradients, {weight_bytes} bytes each{whole}",
        "optimizer": (f"{optimizer} in {'mixed precision' if mixed_precision else 'fp32'} keeps "
                      + (" + ".join(parts) + " bytes, all fp32" if parts else "no state")),
        "activations": (f"the largest shard of {global_batch} samples over {world_size} ranks is "
                        f"{largest_shard} samples, {per_sample} bytes each"),
        "total": "the sum of the four parts",
    }
    return expected, why


def memory_call(n_params, optimizer, mixed_precision, world_size, global_batch, per_sample):
    return (f"memory_per_gpu({n_params:_}, {optimizer!r}, mixed_precision={mixed_precision}, "
            f"world_size={world_size}, global_batch={global_batch}, "
            f"activation_bytes_per_sample={per_sample})")


def check_memory_per_gpu(memory_per_gpu):
    cases = [(n, opt, mixed, world, batch, per)
             for opt in ("adam", "momentum", "sgd") for mixed in (True, False)
             for n, world, batch, per in [(7_500_000_000, 64, 0, 0), (1_500_000_000, 1, 32, 10**9),
                                          (1_000, 4, 10, 3), (12_345, 3, 7, 1_000), (1, 8, 256, 5)]]
    for n, opt, mixed, world, batch, per in cases:
        expected, why = expected_memory(n, opt, mixed, world, batch, per)
        got = memory_per_gpu(n, opt, mixed_precision=mixed, world_size=world, global_batch=batch,
                             activation_bytes_per_sample=per)
        expect_memory(got, expected, memory_call(n, opt, mixed, world, batch, per), n_params=n, why=why)
