"""dpcourse.topics.data_parallel.checks: a memory breakdown compared part by part, with bytes per
parameter and ratios."""

import pytest

from dpcourse.topics.data_parallel.checks import expect_memory, format_bytes, ratio_note
from markers import exercise

pytestmark = exercise("memory_per_gpu")

RIGHT = {"weights": 15e9, "gradients": 15e9, "optimizer": 90e9, "activations": 0, "total": 120e9}


def test_bytes_are_rendered_in_gb_from_a_billion_up():
    assert format_bytes(120e9) == "120 GB"
    assert format_bytes(3072) == "3,072 bytes"
    assert ratio_note(8, 1) == " (8x the expected value)"
    assert ratio_note(1, 1) == "" and ratio_note(0, 5) == ""


def test_a_right_breakdown_passes_ints_or_floats():
    expect_memory(dict(RIGHT), RIGHT, "memory_per_gpu(7.5e9)", n_params=7.5e9)
    expect_memory({k: int(v) for k, v in RIGHT.items()}, RIGHT, "memory_per_gpu(7.5e9)")


def test_a_wrong_part_is_named_with_bytes_per_parameter_the_reason_and_the_ratio():
    got = dict(RIGHT, optimizer=60e9, total=90e9)
    message = (r"'optimizer' is 60 GB \(8 bytes per parameter\), expected 90 GB "
               r"\(12 bytes per parameter\): master copy \(0.667x the expected")
    with pytest.raises(AssertionError, match=message):
        expect_memory(got, RIGHT, "memory_per_gpu(7.5e9)", n_params=7.5e9, why={"optimizer": "master copy"})
    message = r"'activations' is 800 bytes, expected 100 bytes \(8x the expected"
    with pytest.raises(AssertionError, match=message):
        expect_memory(dict(RIGHT, activations=800), dict(RIGHT, activations=100), "m", n_params=7.5e9)


def test_wrong_shapes_of_answer_are_named():
    with pytest.raises(AssertionError, match="should return a dict"):
        expect_memory(120e9, RIGHT, "m")
    with pytest.raises(AssertionError, match=r"without \['total'\]"):
        expect_memory({k: v for k, v in RIGHT.items() if k != "total"}, RIGHT, "m")
    with pytest.raises(AssertionError, match="should be a number of bytes"):
        expect_memory(dict(RIGHT, weights="15 GB"), RIGHT, "m")
