"""The comparison core of every check: render a value, name the rank, pick a tolerance, say how it differs.

Used by the test cells of every notebook (00-06), directly (`expect_equal`, `expect_close`) or
through the other checks modules, and by the hidden checks in autograder/dpgrader/.

Why one core: a learner reads the same kind of sentence in every notebook -- "rank 2: <what> is
<value>, expected <value>" -- with values rendered one way (`describe`, `shorten`), the rank named
one way (`rank_prefix`), and a hint when the numbers have a known signature: data-parallel bugs
make results that are a multiple of the right ones (summing instead of averaging: N times too big),
and `ratio_hint` says so ("4x the expected values"), which points at the bug faster than two lists
of numbers.

Tolerances come from one table (`TOLERANCES`), by dtype like torch.testing.assert_close's (a
comparison takes the looser entry of its two dtypes, so a float32 result is held to float32's
tolerance even against a float64 reference), plus a few named entries for comparisons the dtype
alone does not describe (one float64 algorithm against another: `TOLERANCES["float64 exact"]`).
Every check of the course takes its bound from here. Integers and booleans compare exactly. A
caller that needs another bound passes it: `atol` alone is an absolute bound (rtol 0), `rtol` alone
a relative one.
"""

import torch

TOLERANCES = {  # dtype or named comparison -> (atol, rtol)
    torch.float16: (1e-5, 1e-3),
    torch.bfloat16: (1e-5, 1.6e-2),
    # learner results in float32 against float64 references, a few operations and steps deep
    torch.float32: (2e-5, 1e-4),
    # float64 runs (the DDP chapters, a few hybrid steps): only the order of additions differs, ~1e-15
    # per step
    torch.float64: (1e-9, 1e-7),
    # named comparisons:
    # one float64 algorithm against another, a step deep (a pipeline, tensor-parallel layers): ~1e-16
    "float64 exact": (1e-10, 1e-8),
    # float64 states compared element by element in absolute terms (ZeRO's shards against plain Adam)
    "float64 absolute": (1e-9, 0.0),
    # a float32 wrapper against the module it wraps, the same operations on the same rows: tighter in
    # atol than float32's entry, which allows for float32 results against float64 references
    "float32 same ops": (1e-5, 1e-4),
    # exact float64 sums (notebook 11's dyadic gradients): only the last rounding of a division may differ
    "float64 one rounding": (4e-16, 0.0),
    "float64 dyadic": (1e-12, 0.0),
    # float64 values a few steps deep compared element by element (11's simulations, 10's AdamW)
    "float64 steps absolute": (1e-10, 0.0),
    # float64 numbers against their formulas (a loss, a planner's prediction): relative, an absolute floor
    "float64 scalar": (1e-12, 1e-9),
    # an expert's output row against the single-process layer (notebook 12): which tokens went wrong
    "float64 rows": (1e-8, 0.0),
    # the numerical rank of a float64 matrix (PowerSGD's P and Q): singular values below rtol * the largest
    "numerical rank": (0.0, 1e-10),
    # a message or a value recognised as a sum of inputs added in any order (dpcourse.comm.provenance)
    "half sums in any order": (1e-2, 1e-2),
    "float32 sums in any order": (1e-5, 1e-5),
    "float64 sums in any order": (1e-9, 1e-9),
}
ATOL, RTOL = TOLERANCES[torch.float32]  # the float32 entry, under the names older code imports


def tolerance(*dtypes, atol=None, rtol=None):
    """(atol, rtol) for comparing tensors of these dtypes: the loosest table entry among them,
    (0, 0) for integers and booleans. atol alone is an absolute bound, rtol alone a relative one."""
    if atol is not None or rtol is not None:
        return (atol or 0.0, rtol or 0.0)
    entries = [TOLERANCES.get(d, (0.0, 0.0)) for d in dtypes]
    return max(e[0] for e in entries), max(e[1] for e in entries)


def is_close(got, expected, atol=None, rtol=None):
    """True when two tensors have the same shape and equal values within the tolerance (no NaN)."""
    if got.shape != expected.shape:
        return False
    atol, rtol = tolerance(got.dtype, expected.dtype, atol=atol, rtol=rtol)
    g, e = got.detach().cpu(), expected.detach().cpu()
    if not (g.is_floating_point() or e.is_floating_point()):
        return torch.equal(g, e.to(g.dtype)) if g.dtype != e.dtype else torch.equal(g, e)
    return torch.allclose(g.double(), e.double(), atol=atol, rtol=rtol)


def shorten(values, limit=8, fmt=repr, more="count", total=None):
    """The first `limit` values joined by commas, then ', … (N values)' (more="count") or ', ...'.

    `total`: how many values there are, when `values` holds only the first ones.
    """
    values = list(values)
    total = len(values) if total is None else total
    shown = ", ".join(fmt(v) for v in values[:limit])
    if total <= limit:
        return shown
    return shown + (f", … ({total} values)" if more == "count" else ", ...")


def number(value):
    """A number as a person reads it: floats to 6 significant digits (enough to see what is wrong,
    and the same from run to run: a sum taken in another order changes only the last digits)."""
    if not isinstance(value, float):
        return repr(value)
    text = f"{value:.6g}"
    return text if any(c in text for c in ".einf") else text + ".0"  # 4.0, not 4: still a float


def describe(value, limit=8):
    """A short, readable rendering of a value for a failure message (floats to 6 digits, as `number`)."""
    if isinstance(value, torch.Tensor):
        flat = value.detach().flatten()
        shown = shorten(flat[:limit].tolist(), limit, fmt=lambda v: f"{v:g}", total=flat.numel())
        return f"tensor([{shown}], shape={tuple(value.shape)}, dtype={str(value.dtype)[6:]})"
    if type(value) is dict:
        return "{" + ", ".join(f"{k!r}: {describe(v, limit)}" for k, v in value.items()) + "}"
    if type(value) in (list, tuple) and len(value) <= limit:
        inner = ", ".join(describe(v, limit) for v in value)
        return f"[{inner}]" if type(value) is list else f"({inner}{',' if len(value) == 1 else ''})"
    return number(value)


def rank_prefix(rank=None):
    """'rank 2: ' to start a message about one rank, '' when it is about no rank in particular."""
    return f"rank {rank}: " if rank is not None else ""


def ratio_hint(got, expected):
    """' (4x the expected values)' when `got` is a multiple (other than 1) of `expected`, else ''."""
    got, expected = got.detach().double().flatten().cpu(), expected.detach().double().flatten().cpu()
    denominator = float(expected @ expected)
    if denominator < 1e-18 or got.shape != expected.shape:
        return ""
    c = float(got @ expected) / denominator
    if abs(c - 1) > 1e-3 and (got - c * expected).norm() <= 1e-3 * (c * expected).norm():
        return f" ({c:.3g}x the expected values)"
    return ""


def float_hint(got, expected):
    """ratio_hint for floating-point tensors of the same shape; '' for anything else."""
    if (isinstance(got, torch.Tensor) and isinstance(expected, torch.Tensor) and got.shape == expected.shape
            and got.is_floating_point() and expected.is_floating_point()):
        return ratio_hint(got, expected)
    return ""


def expect_equal(got, expected, what, rank=None, atol=0.0, rtol=0.0):
    """Assert got == expected (tensors: same shape, same dtype, values within atol/rtol, exact by
    default). The dtype is part of the answer: indices in float32, or a sum returned in float32 for
    float64 inputs, fail with both dtypes named, even when the values compare equal."""
    where = rank_prefix(rank)
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"{where}{what} should be a tensor, got {describe(got)}")
        if got.shape != expected.shape:
            raise AssertionError(f"{where}{what} has shape {tuple(got.shape)}, expected "
                                 f"{tuple(expected.shape)}: got {describe(got)}, expected "
                                 f"{describe(expected)}")
        if got.dtype != expected.dtype:
            raise AssertionError(f"{where}{what} has dtype {str(got.dtype)[6:]}, expected "
                                 f"{str(expected.dtype)[6:]}: got {describe(got)}{dtype_hint(got, expected)}")
        if not is_close(got, expected, atol=atol, rtol=rtol):
            raise AssertionError(f"{where}{what} is {describe(got)}, expected {describe(expected)}"
                                 f"{float_hint(got, expected)}")
    elif got != expected:
        raise AssertionError(f"{where}{what} is {describe(got)}, expected {describe(expected)}")


def dtype_hint(got, expected):
    """Why a dtype may be wrong, in a few words: indices must be integers, results keep the input's."""
    if expected.dtype in (torch.int64, torch.int32) and got.is_floating_point():
        return " (indices must be integers: build them with torch.arange or torch.tensor of ints)"
    if got.is_floating_point() and expected.is_floating_point():
        return (" (keep the input's dtype: a new tensor from torch.zeros(...) or torch.empty(...) is "
                "float32 unless you pass dtype=, torch.empty_like(x) keeps x's)")
    return ""


def known_mistake(got, suspects):
    """The hint of the first known wrong answer that `got` matches, else ''.

    got: a tensor or a list of tensors (one per parameter, or one per rank). suspects: {hint: the
    wrong answer, shaped like got}, computed independently (dpcourse.reference.mistakes). Why: a
    learner whose result equals "the plain mean of the shard means" learns more from that sentence
    than from two lists of numbers.
    """
    many = isinstance(got, (list, tuple))
    got = list(got) if many else [got]
    for hint, wrong in (suspects or {}).items():
        wrong = list(wrong) if many else [wrong]
        if len(wrong) == len(got) and all(isinstance(g, torch.Tensor) and is_close(g.detach().cpu(), w)
                                          for g, w in zip(got, wrong, strict=True)):
            return hint
    return ""


def expect_close(got, expected, what, atol=None, rtol=None, rank=None, hint=""):
    """Assert tensor `got` is close to `expected` (any dtype, any device; the table's tolerance).
    `hint` ends the message on a mismatch of values (what the result looks like instead)."""
    where = rank_prefix(rank)
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{where}{what} should be a tensor, got {describe(got)[:200]}")
    got = got.detach().cpu()
    if got.shape != expected.shape:
        raise AssertionError(f"{where}{what} has shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
    if got.is_floating_point() and not torch.isfinite(got).all():
        raise AssertionError(f"{where}{what} contains nan or inf: {describe(got)} (a division by an empty "
                             f"shard's size, or by a zero variance?)")
    if not is_close(got, expected, atol=atol, rtol=rtol):
        raise AssertionError(f"{where}{what} is {describe(got)}, expected {describe(expected)}"
                             f"{ratio_hint(got, expected)}" + (f": {hint}" if hint else ""))


# --------------------------------------------------------- refusals ("raise a ValueError that says so")

def what_it_raises(call, *args, **kwargs):
    """Run call(*args, **kwargs) (on a rank) and say what it raised: "<type name>: <message>", or "nothing".

    The type's own name, not the ValueError it may derive from: the course's layout checks raise a
    subclass of ValueError (dpcourse.comm.recorder.TensorLayoutError) when a collective is given sizes that
    do not fit, and that is not the learner's refusal.
    """
    try:
        call(*args, **kwargs)
    except Exception as error:  # the learner's exception, whatever it is, is the answer
        return f"{type(error).__name__}: {error}"
    return "nothing"


def expect_says_why(raised, what, numbers, rule, rank=None):
    """`raised` (what_it_raises' answer) is a ValueError whose message gives each of `numbers` as a number
    of its own. numbers: {what the number counts: value}, e.g. {"positions": 5, "ranks": 2}; rule: what the
    text asks for. Why the numbers: "a ValueError that says so" is graded on the saying too."""
    who = "it" if rank is None else f"rank {rank}"
    if raised == "nothing":
        raise AssertionError(f"{what}: {who} raised nothing: expected a ValueError ({rule})")
    if not raised.startswith("ValueError:"):
        raise AssertionError(f"{what}: {who} raised {raised[:200].rstrip(': ')}: expected a ValueError of "
                             f"your own ({rule})")
    if missing_numbers(raised, numbers):
        raise AssertionError(f"{what}: {who} raised {raised[:200]}: a ValueError, but its message should say "
                             f"why, giving the numbers {wanted_numbers(numbers)} ({rule})")


def missing_numbers(text, numbers):
    """The values of `numbers` ({name: value}) that `text` does not give as numbers of their own."""
    import re

    return [v for v in numbers.values() if not re.search(rf"(?<![\d.]){v}(?![\d.])", text)]


def wanted_numbers(numbers):
    """{"positions": 5, "ranks": 2} -> '5 (positions) and 2 (ranks)'."""
    return " and ".join(f"{value} ({name})" for name, value in numbers.items())
