"""Checks for a DataParallel-like wrapper: same outputs and same gradients as the plain module.

Used by notebook 02 (the MiniDataParallel and scatter test cells) and its hidden checks.

The reference is the module itself, called once on the whole batch: a
data-parallel wrapper must be invisible, up to rounding. When it is not, the
message says how: pieces of the wrong size or on the wrong device, output rows
in the wrong order, an output that lost its tuple structure, gradients that do
not reach the module's parameters.
"""

import torch

from dpcourse.checks.core import describe, float_hint, is_close

# a wrapper must be invisible up to the rounding of float32 outputs: tighter in atol than the core
# table's float32 entry, which allows for float32 results against float64 references
ATOL, RTOL = 1e-5, 1e-4


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


def expect_like_module(wrapper, module, args, kwargs=None, what="the wrapper", output_device=None):
    """The wrapper called on (args, kwargs) gives the module's output, and the same gradients.

    `module` must be the wrapped module (its parameters are the ones checked); it
    is called once on the whole batch for the expected values.
    """
    kwargs = kwargs or {}
    params = [p for p in module.parameters() if p.requires_grad]
    expected = module(*args, **kwargs)
    expected_grads = torch.autograd.grad(scalar_of(expected), params, allow_unused=True)
    try:
        got = wrapper(*args, **kwargs)
    except AssertionError:
        raise
    except Exception as exc:  # say which case broke, keep the learner's error in the message
        raise AssertionError(f"{what} raised {type(exc).__name__}: {exc}") from exc
    expect_same_structure(got, expected, f"the output of {what}", devices=None)
    if output_device is not None:
        for t in tensor_leaves(got):
            if t.device != torch.device(output_device):
                raise AssertionError(f"the output of {what} is on {t.device}, expected the output device "
                                     f"{torch.device(output_device)}")
    loss = scalar_of(got)
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
        raise AssertionError(f"the output of {what} does not require grad: gradients cannot flow back to "
                             f"the module's parameters (was it detached, or computed under no_grad?)")
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    for name, g, e in zip(names, grads, expected_grads, strict=True):
        if e is None:
            continue
        if g is None:
            raise AssertionError(f"after backward through {what}, {name} got no gradient")
        g, e = g.detach().cpu(), e.detach().cpu()
        if not is_close(g, e, atol=ATOL, rtol=RTOL):
            raise AssertionError(f"after backward through {what}, the gradient of {name} is {describe(g)}, "
                                 f"expected {describe(e)} (the plain module's){float_hint(g, e)}")
