"""Hidden checks of 02_dataparallel. Each raises a short AssertionError saying what is wrong.

The reference is always the plain module on the whole batch, or index arithmetic
for scatter's pieces. The learner's MiniDataParallel is built and called inside a one-rank
launch (dpcourse.topics.data_parallel.checks.run_like_module), which returns plain outputs, gradients and
the probe's records; what needs the very same objects (scatter passing a non-tensor along,
gradients flowing back through the pieces) is also tried inside a rank, which reports plain
facts. CPU "devices" are checked everywhere; real GPUs only where the machine has at least two
(the check says when it skipped them).
"""

from functools import partial

import torch

from dpcourse import launch
from dpcourse.checks.core import describe
from dpcourse.reference.splits import chunk_bounds, chunk_sizes
from dpcourse.topics.data_parallel.checks import (
    expect_like_module,
    expect_like_module_results,
    expect_same_structure,
    run_like_modules,
)
from dpcourse.topics.data_parallel.probes import Fails, Keywords, ParallelProbe, TwoHeads, indexed_batch
from dpcourse.topics.data_parallel.replicas import cpu_devices, gpu_devices
from dpcourse.toys.models import mlp

# What each exercise's expected values come from (autograder/exercises.json lists them).
REFERENCES = {
    "scatter": "row ranges of torch.tensor_split's rule (dpcourse.reference.splits), written out",
    "mini_data_parallel": "the wrapped module called once on the whole batch: its output and its gradients",
}


def expected_pieces(obj, sizes, devices):
    """Piece i of a nested object, by explicit row ranges."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]

    def piece(o, i):
        if isinstance(o, torch.Tensor):
            return o[starts[i]:starts[i] + sizes[i]].to(devices[i])
        if isinstance(o, tuple):
            return tuple(piece(v, i) for v in o)
        if isinstance(o, list):
            return [piece(v, i) for v in o]
        if isinstance(o, dict):
            return {k: piece(v, i) for k, v in o.items()}
        return o

    return [piece(obj, i) for i in range(len(sizes))]


def check_pieces(scatter, obj, devices, rows, what):
    used = max(1, min(len(devices), rows)) if rows is not None else len(devices)
    sizes = chunk_sizes(rows, used) if rows is not None else [0] * used
    expected = expected_pieces(obj, sizes, devices)
    got = scatter(obj, devices)
    if not isinstance(got, list):
        raise AssertionError(f"scatter of {what} over {len(devices)} devices should return a list, got "
                             f"{describe(got)[:200]}")
    if len(got) != len(expected):
        raise AssertionError(f"scatter of {what} over {len(devices)} devices gave {len(got)} pieces, "
                             f"expected {len(expected)}" + (f" (pieces of sizes {sizes})" if rows else ""))
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        expect_same_structure(g, e, f"scatter of {what} over {len(devices)} devices: piece {i}",
                              devices=devices[i])
    return got


def scatter_facts(scatter):
    """Inside a rank (it needs the very objects): is a non-tensor passed along as the same object,
    and does the gradient of sum_i (i + 1) * piece_i reach the caller's 7x2 tensor? Plain answers."""
    label = object()
    pieces = scatter({"x": torch.zeros(6, 2), "label": label}, cpu_devices(4))
    same = None
    if isinstance(pieces, list):
        same = [isinstance(p, dict) and p.get("label") is label for p in pieces]
    x = torch.ones(7, 2, requires_grad=True)
    pieces = scatter(x, cpu_devices(3))
    total = sum((p * (i + 1)).sum() for i, p in enumerate(pieces))
    requires_grad = isinstance(total, torch.Tensor) and total.requires_grad
    grad = torch.autograd.grad(total, [x])[0] if requires_grad else None
    return {"same_object": same, "requires_grad": requires_grad, "grad": grad}


def check_scatter(scatter):
    skipped = []
    device_sets = [("CPU", cpu_devices)]
    gpus = gpu_devices()
    if len(gpus) >= 2:
        device_sets.append(("GPU", lambda n: [gpus[i % len(gpus)] for i in range(n)]))
    else:
        skipped.append("(this machine has fewer than 2 GPUs)")
    for kind, make in device_sets:
        x = torch.arange(30.0).reshape(10, 3)
        y = torch.arange(10)
        check_pieces(scatter, x, make(4), 10, f"a ({kind}) 10x3 tensor")
        check_pieces(scatter, x[:7], make(3), 7, f"a ({kind}) batch of 7")
        check_pieces(scatter, x[:3], make(4), 3, f"a ({kind}) batch of 3 (fewer rows than devices)")
        check_pieces(scatter, x[:5], make(1), 5, f"a ({kind}) batch of 5 on one device")
        check_pieces(scatter, (x, y), make(3), 10, f"a ({kind}) tuple (x, y)")
        check_pieces(scatter, [x, [y, "tag"]], make(2), 10, f"a ({kind}) nested list [x, [y, 'tag']]")
        check_pieces(scatter, {"x": x[:6], "scale": 2.5, "label": "tag", "none": None}, make(4), 6,
                     f"a ({kind}) dict with a tensor, a float, a string and None")
        check_pieces(scatter, ((x[:9],), {"offset": y[:9], "scale": 0.5}), make(3), 9,
                     f"({kind}) (inputs, kwargs) as MiniDataParallel passes them")
        check_pieces(scatter, (1, "a"), make(3), None, f"({kind}) an object holding no tensor")
    facts = launch(scatter_facts, 1, scatter)[0]
    if facts["same_object"] is not None and not all(facts["same_object"]):
        raise AssertionError(f"scatter of a dict holding an object that is not a tensor: the pieces hold the "
                             f"same object {facts['same_object']} (True = the caller's own object): "
                             f"pass anything that is not a tensor, tuple, list or dict along unchanged, "
                             f"not a copy")
    # gradients flow back through the pieces
    if not facts["requires_grad"]:
        raise AssertionError("scatter's pieces of a tensor that requires grad do not require grad: "
                             "gradients could not flow back to the inputs")
    expected = torch.tensor([1.0] * 3 + [2.0] * 2 + [3.0] * 2).unsqueeze(1).expand(7, 2)
    if not torch.equal(facts["grad"], expected):
        raise AssertionError(f"the gradient through scatter's pieces is {describe(facts['grad'])}, expected "
                             f"{describe(expected)}")
    if skipped:
        print("scatter: hidden checks on real GPUs SKIPPED", *skipped)


def check_mini_data_parallel(MiniDataParallel):
    """Every CPU case runs in one launch (`run_like_modules`); verdicts are reached here, in order."""
    cpu = cpu_devices
    uneven = []  # uneven batches, one device, more devices than rows
    for rows, n in [(7, 3), (5, 1), (2, 4), (13, 5)]:
        uneven.append((rows, n, mlp(4, 8, 2, seed=rows), indexed_batch(rows, seed=n)))
    late = mlp(4, 8, 3, seed=1)
    heads = TwoHeads(seed=3)
    keywords = Keywords(seed=2)
    x7, offset = indexed_batch(7, seed=2), torch.randn(7, 2, generator=torch.Generator().manual_seed(2))
    cases = [dict(module=model, devices=cpu(n), args=(x,), wrap=ParallelProbe) for _, n, model, x in uneven]
    cases += [
        # every replica in its own thread, outputs in device order whatever finishes first
        dict(module=late, devices=cpu(3), args=(indexed_batch(9),),
             wrap=partial(ParallelProbe, parties=3, first_finishes_last=0.2)),
        # no_grad is carried into the threads
        dict(module=mlp(4, 8, 2, seed=4), devices=cpu(2), args=(indexed_batch(6),), wrap=ParallelProbe,
             no_grad=True),
        # an exception in a replica reaches the caller
        dict(module=Fails(bad_row=5), devices=cpu(3), args=(indexed_batch(9),)),
        # tuple outputs, nested, with a non-tensor inside
        dict(module=heads, devices=cpu(4), args=(indexed_batch(10),)),
        # keyword inputs: a tensor split with the batch, a number passed to every replica
        dict(module=keywords, devices=cpu(3), args=(x7,), kwargs=dict(scale=0.5, offset=offset)),
    ]
    runs = run_like_modules(MiniDataParallel, cases)
    for (rows, n, model, x), run in zip(uneven, runs, strict=False):
        what = f"MiniDataParallel on {n} CPU devices, batch of {rows}"
        expect_like_module_results(run, model, (x,), what=what)
        used = sorted(tuple(c["rows"]) for c in run["calls"])
        want = [tuple(range(a, b)) for a, b in chunk_bounds(rows, min(n, rows))]
        if used != sorted(want):
            raise AssertionError(f"{what}: the replicas ran on rows {[list(u) for u in used]}, expected "
                                 f"{[list(w) for w in want]}")
    late_run, no_grad_run, fails_run, heads_run, keywords_run = runs[len(uneven):]
    expect_like_module_results(late_run, late, cases[len(uneven)]["args"],
                               what="MiniDataParallel on 3 CPU devices whose first replica finishes last")
    if no_grad_run["error"] is not None:
        raise AssertionError(f"MiniDataParallel under torch.no_grad() raised {no_grad_run['error'][0]}: "
                             f"{no_grad_run['error'][1]}")
    if no_grad_run["requires_grad"] or any(call["grad_enabled"] for call in no_grad_run["calls"]):
        raise AssertionError("under torch.no_grad() the replicas of MiniDataParallel ran with grad enabled "
                             "(building graphs nobody will use): grad mode is per thread, so set it in "
                             "each thread with torch.set_grad_enabled(...)")
    if fails_run["error"] is None:
        raise AssertionError("a replica raised ValueError('row 5 is corrupt'), but MiniDataParallel returned "
                             "normally: re-raise a replica's exception in the caller")
    kind, message = fails_run["error"]
    if kind != "ValueError" or "row 5 is corrupt" not in message:
        raise AssertionError(f"a replica raised ValueError('row 5 is corrupt') but the caller got "
                             f"{kind}({message!r})")
    expect_like_module_results(heads_run, heads, cases[-2]["args"],
                               what="MiniDataParallel of a module returning (scores, (embedding, 'label'))")
    expect_like_module_results(keywords_run, keywords, (x7,), dict(scale=0.5, offset=offset),
                               what="MiniDataParallel with keyword inputs scale=0.5, offset=<7x2 tensor>")
    check_mini_data_parallel_on_gpus(MiniDataParallel)


def check_mini_data_parallel_on_gpus(MiniDataParallel):
    """The real-device path (torch.nn.parallel.replicate); needs >= 2 GPUs, says when it skipped."""
    gpus = gpu_devices()
    if len(gpus) < 2:
        print("MiniDataParallel: check on real GPUs SKIPPED (this machine has fewer than 2 GPUs)")
        return
    devices = gpus[:2]
    model = mlp(4, 8, 2, seed=5).to(devices[0])
    x = indexed_batch(7).to(devices[0])
    expect_like_module(MiniDataParallel, model, devices, (x,),
                       what=f"MiniDataParallel on {devices}", output_device=devices[0])
    model = TwoHeads(seed=6).to(devices[0])
    expect_like_module(MiniDataParallel, model, devices, (indexed_batch(5).to(devices[0]),),
                       wrapper_kwargs=dict(output_device=devices[1]),
                       what=f"MiniDataParallel on {devices} with output_device {devices[1]}",
                       output_device=devices[1])
