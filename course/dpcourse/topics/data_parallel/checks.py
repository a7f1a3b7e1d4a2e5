"""Checks of the data-parallel basics: a DataParallel-like wrapper (notebook 02) and a memory breakdown
per GPU (notebook 01).

## A DataParallel-like wrapper: same outputs and same gradients as the plain module

Used by notebook 02 (the MiniDataParallel and scatter test cells) and its hidden checks.
The learner's wrapper is built and called inside a one-rank launch (`run_like_module`), which
returns plain values: outputs, gradients, devices, the probe's records. The test cell calls the
plain module itself and compares (`expect_like_module_results`): the grader never holds the
learner's objects (docs/authoring.md, rules 1-3).

The reference is the module itself, called once on the whole batch: a
data-parallel wrapper must be invisible, up to rounding. When it is not, the
message says how: pieces of the wrong size or on the wrong device, output rows
in the wrong order, an output that lost its tuple structure, gradients that do
not reach the module's parameters.

## A memory breakdown {weights, gradients, optimizer, activations, total}, part by part

    expect_memory(got, {"weights": 15e9, ...}, "memory_per_gpu(7.5e9)", n_params=7.5e9,
                  why={"optimizer": "fp32 master weights 4 + momentum 4 + variance 4"})

Used by notebook 01 (exercise `memory_per_gpu`: its test cells and the hidden check
dpgrader.first_principles.checks.check_memory_per_gpu).

Why a module: a wrong memory estimate is wrong in one part, by a telling factor. The message
names the part, gives both values in GB (10^9 bytes, as the ZeRO paper counts) and in bytes
per parameter ("8 bytes per parameter, expected 12"), says why the expected value is what it
is, and gives the ratio when one is a multiple of the other ("8x the expected value": the
activations of the global batch instead of one rank's share).
"""

import math
from numbers import Real

import torch

from dpcourse.checks.core import TOLERANCES, describe, float_hint, is_close

# a wrapper must be invisible up to the rounding of float32 outputs
ATOL, RTOL = TOLERANCES["float32 same ops"]


def _where(path):
    return "".join(f"[{p!r}]" for p in path) or "the value"


def expect_same_structure(got, expected, what, path=(), devices=None, atol=ATOL, rtol=RTOL):
    """Compare nested tuples / lists / dicts of tensors and other objects.

    Tensors: same shape and values (and, if `devices` names one, on that device);
    tuples, lists, dicts: same type and keys; anything else: the very same object.
    """
    where = f"{what}, {_where(path)}" if path else what
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"{where} should be a tensor, got {describe(got)[:200]}")
        if devices is not None and got.device != torch.device(devices):
            raise AssertionError(f"{where} is on {got.device}, expected {torch.device(devices)}")
        if got.shape != expected.shape:
            raise AssertionError(f"{where} has shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
        g, e = got.detach().cpu(), expected.detach().cpu()
        same = is_close(g, e, atol=atol, rtol=rtol) if g.is_floating_point() else torch.equal(g, e)
        if not same:
            raise AssertionError(f"{where} is {describe(g)}, expected {describe(e)}{float_hint(g, e)}"
                                 f"{row_order_hint(g, e)}")
        return
    if isinstance(expected, (tuple, list, dict)):
        if type(got) is not type(expected):
            shown = type(got).__name__ if isinstance(got, (tuple, list, dict)) else describe(got)[:200]
            raise AssertionError(f"{where} should be a {type(expected).__name__}, got a {shown}")
        if isinstance(expected, dict):
            if list(got) != list(expected):
                raise AssertionError(f"{where} has keys {list(got)}, expected {list(expected)}")
            for key in expected:
                expect_same_structure(got[key], expected[key], what, (*path, key), devices, atol, rtol)
            return
        if len(got) != len(expected):
            raise AssertionError(f"{where} has {len(got)} elements, expected {len(expected)}")
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            expect_same_structure(g, e, what, (*path, i), devices, atol, rtol)
        return
    if isinstance(got, torch.Tensor) or (got is not expected and got != expected):
        raise AssertionError(f"{where} is {describe(got)[:200]}, expected {describe(expected)[:200]} "
                             f"(objects that are not tensors are passed along unchanged)")


def row_order_hint(got, expected):
    """' (its rows are rows [3, 4, 0, ...] of the expected output ...)' when got permutes expected's rows."""
    if got.dim() == 0 or got.shape != expected.shape or len(got) < 2:
        return ""
    order = []
    for row in got:
        match = [i for i in range(len(expected)) if is_close(row, expected[i], atol=ATOL, rtol=RTOL)]
        if not match:
            return ""
        order.append(match[0])
    if sorted(order) != list(range(len(expected))):
        return ""
    return (f" (its rows are rows {order} of the expected output: gather the replicas' outputs in "
            f"device order, not in the order they finish)")


def tensor_leaves(obj):
    """The tensors inside a nested output, in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in tensor_leaves(o)]
    return []


def scalar_of(output):
    """A fixed weighted sum of every floating-point tensor in `output`: a loss that uses all of it."""
    total = 0.0
    for t in tensor_leaves(output):
        if t.is_floating_point():
            weights = torch.linspace(-1.0, 2.0, t.numel(), device=t.device, dtype=t.dtype).reshape(t.shape)
            total = total + (t * weights).sum().to("cpu", torch.float64)
    return total


def like_module_run(wrapper_cls, module, devices, args, kwargs=None, wrap=None, wrapper_kwargs=None,
                    no_grad=False):
    """Inside a rank: build `wrapper_cls(wrap(module), devices, **wrapper_kwargs)`, call it on
    (args, kwargs) and return what happened as plain values (docs/authoring.md, rules 1-2).

    Why in a rank: a test cell never holds the learner's wrapper; it launches this function and
    compares the plain results with the module it called itself (`expect_like_module_results`).
    `wrap` (picklable, e.g. `functools.partial(ParallelProbe, parties=4)`) turns the module into
    the one the wrapper gets; if that object records `.calls`, they come back too.
    Returns {"error": [type name, message] or None, "output": the output with tensors detached on
    the CPU, "devices": the device of each output tensor, "requires_grad": whether the output can
    be differentiated, "grads": the gradients of `module`'s parameters (None where none), "calls"}.
    """
    target = wrap(module) if wrap is not None else module
    run = {"error": None, "output": None, "devices": [], "requires_grad": False, "grads": [],
           "calls": None}
    try:
        wrapper = wrapper_cls(target, devices, **(wrapper_kwargs or {}))
        if no_grad:
            with torch.no_grad():
                out = wrapper(*args, **(kwargs or {}))
        else:
            out = wrapper(*args, **(kwargs or {}))
    except Exception as exc:  # noqa: BLE001 - the test cell names the case and the learner's error
        run["error"] = [type(exc).__name__, str(exc)]
        run["calls"] = _plain_calls(target)
        return run
    params = [p for p in module.parameters() if p.requires_grad]
    loss = scalar_of(out)
    run["requires_grad"] = isinstance(loss, torch.Tensor) and loss.requires_grad
    if run["requires_grad"]:
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        run["grads"] = [None if g is None else g.detach().cpu() for g in grads]
    run.update(output=_plain_output(out), devices=[str(t.device) for t in tensor_leaves(out)],
               calls=_plain_calls(target))
    return run


def _plain_output(obj):
    """The output with tensors detached on the CPU, containers kept, other objects shown as text
    unless they are plain (numbers, strings, None)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, (tuple, list)):
        return type(obj)(_plain_output(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _plain_output(v) for k, v in obj.items()}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return f"<a {type(obj).__name__} object>"


def _plain_calls(target):
    calls = getattr(target, "calls", None)
    return [dict(c) for c in calls] if isinstance(calls, list) else None


def run_like_module(wrapper_cls, module, devices, args, kwargs=None, *, wrap=None, wrapper_kwargs=None,
                    no_grad=False):
    """`like_module_run` in a one-rank launch: the learner's wrapper is built and used there."""
    from dpcourse.runtime.launcher import launch  # not at import: checks stay importable without ranks

    return launch(like_module_run, 1, wrapper_cls, module, devices, tuple(args), dict(kwargs or {}), wrap,
                  dict(wrapper_kwargs or {}), no_grad)[0]


def like_module_runs(wrapper_cls, cases):
    """Inside a rank: `like_module_run` of every case (a dict of its keyword arguments), in order."""
    return [like_module_run(wrapper_cls, **case) for case in cases]


def run_like_modules(wrapper_cls, cases):
    """Several `like_module_run` cases in one one-rank launch (a launch costs ~0.5 s while graded)."""
    from dpcourse.runtime.launcher import launch

    return launch(like_module_runs, 1, wrapper_cls, list(cases))[0]


def expect_like_module_results(run, module, args, kwargs=None, what="the wrapper", output_device=None):
    """The wrapper's run (`like_module_run`) gave the module's output and the same gradients.

    `module` is the wrapped module (its parameters are the ones checked); it is called here, once
    on the whole batch, for the expected values.
    """
    kwargs = kwargs or {}
    if run["error"] is not None:
        kind, message = run["error"]
        if kind == "AssertionError":  # a probe's own diagnosis ("the replicas did not run in parallel")
            raise AssertionError(message)
        raise AssertionError(f"{what} raised {kind}: {message}")
    params = [p for p in module.parameters() if p.requires_grad]
    expected = module(*args, **kwargs)
    expected_grads = torch.autograd.grad(scalar_of(expected), params, allow_unused=True)
    expect_same_structure(run["output"], _plain_output(expected), f"the output of {what}", devices=None)
    if output_device is not None:
        for device in run["devices"]:
            if torch.device(device) != torch.device(output_device):
                raise AssertionError(f"the output of {what} is on {device}, expected the output device "
                                     f"{torch.device(output_device)}")
    if not run["requires_grad"]:
        raise AssertionError(f"the output of {what} does not require grad: gradients cannot flow back to "
                             f"the module's parameters (was it detached, or computed under no_grad?)")
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    for name, g, e in zip(names, run["grads"], expected_grads, strict=True):
        if e is None:
            continue
        if g is None:
            raise AssertionError(f"after backward through {what}, {name} got no gradient")
        e = e.detach().cpu()
        if not is_close(g, e, atol=ATOL, rtol=RTOL):
            raise AssertionError(f"after backward through {what}, the gradient of {name} is {describe(g)}, "
                                 f"expected {describe(e)} (the plain module's){float_hint(g, e)}")


def expect_like_module(wrapper_cls, module, devices, args, kwargs=None, *, what="the wrapper", wrap=None,
                       wrapper_kwargs=None, output_device=None):
    """Run the learner's wrapper class in a rank (`run_like_module`) and compare it with `module`
    called here (`expect_like_module_results`). Returns the run (its `calls`, for further checks)."""
    run = run_like_module(wrapper_cls, module, devices, args, kwargs, wrap=wrap,
                          wrapper_kwargs=wrapper_kwargs)
    expect_like_module_results(run, module, args, kwargs, what=what, output_device=output_device)
    return run



PARTS = ("weights", "gradients", "optimizer", "activations", "total")
PER_PARAMETER = ("weights", "gradients", "optimizer")  # parts that scale with the parameter count


def format_bytes(value):
    """'120 GB' (10^9 bytes) from a billion bytes up, else '3,072 bytes'."""
    if abs(value) >= 1e9:
        return f"{value / 1e9:.4g} GB"
    return f"{value:,.0f} bytes" if float(value).is_integer() else f"{value:,.2f} bytes"


def ratio_note(got, expected):
    """' (8x the expected value)' when got is a multiple other than 1 of expected, else ''."""
    if not expected or not got:
        return ""
    ratio = got / expected
    return "" if math.isclose(ratio, 1.0, rel_tol=1e-9) else f" ({ratio:.3g}x the expected value)"


def describe_part(value, n_params):
    """'60 GB (8 bytes per parameter)', or without the per-parameter figure when n_params is None."""
    per = f" ({value / n_params:.3g} bytes per parameter)" if n_params else ""
    return f"{format_bytes(value)}{per}"


def expect_memory(got, expected, call, n_params=None, why=None):
    """Assert that `got` is a dict with the five PARTS, each a number equal to `expected`'s.

    call: how the function was called, to start the message. n_params: shows weights, gradients
    and optimizer per parameter. why: {part: the reason for its expected value}, added to the message.
    """
    why = why or {}
    if not isinstance(got, dict):
        raise AssertionError(f"{call} should return a dict with keys {list(PARTS)}, got {type(got).__name__}")
    missing = [part for part in PARTS if part not in got]
    if missing:
        raise AssertionError(f"{call} returned a dict without {missing} (keys {sorted(map(str, got))}); "
                             f"expected keys {list(PARTS)}")
    for part in PARTS:
        value, want = got[part], expected[part]
        if isinstance(value, bool) or not isinstance(value, Real):
            raise AssertionError(f"{call}[{part!r}] should be a number of bytes, got {value!r}")
        if math.isclose(value, want, rel_tol=1e-9, abs_tol=1e-6):
            continue
        per = n_params if part in PER_PARAMETER else None
        reason = f": {why[part]}" if part in why else ""
        raise AssertionError(f"{call}: {part!r} is {describe_part(value, per)}, expected "
                             f"{describe_part(want, per)}{reason}{ratio_note(value, want)}")
