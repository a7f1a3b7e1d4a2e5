"""Compare a memory breakdown {weights, gradients, optimizer, activations, total} part by part.

    expect_memory(got, {"weights": 15e9, ...}, "memory_per_gpu(7.5e9)", n_params=7.5e9,
                  why={"optimizer": "fp32 master weights 4 + momentum 4 + variance 4"})

Used by notebook 01 (exercise `memory_per_gpu`: its test cells and the hidden check
dpgrader.first_principles.check_memory_per_gpu).

Why a module: a wrong memory estimate is wrong in one part, by a telling factor. The message
names the part, gives both values in GB (10^9 bytes, as the ZeRO paper counts) and in bytes
per parameter ("8 bytes per parameter, expected 12"), says why the expected value is what it
is, and gives the ratio when one is a multiple of the other ("8x the expected value": the
activations of the global batch instead of one rank's share).
"""

import math
from numbers import Real

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
