"""dpcourse.topics.compression.costs: the byte formulas of notebook 11."""

from dpcourse.topics.compression.costs import compressible, matrix_shape, powersgd_elements, topk_handed_bytes
from markers import exercise


@exercise("topk_all_reduce")
def test_topk_hands_k_values_and_k_int32_indices():
    assert topk_handed_bytes(3, 8) == 36
    assert topk_handed_bytes(25_600, 4) == 204_800


@exercise("powersgd_hook")
def test_a_matrix_is_compressed_only_when_its_factors_are_smaller():
    assert compressible((16, 16), 1) and compressible((16, 8), 1)
    assert compressible((2, 16), 1) and not compressible((2, 16), 2)  # 18 < 32, 36 > 32
    assert not compressible((16,), 1)
    assert not compressible((16, 8), 16)  # r = min(16, 16, 8) = 8: 192 > 128
    assert compressible((64, 3, 3, 3), 4) and matrix_shape((64, 3, 3, 3)) == (64, 27)


@exercise("powersgd_hook")
def test_powersgd_elements_of_the_tests_model():
    shapes = [(16, 8), (16,), (16, 16), (16,), (2, 16), (2,)]
    assert powersgd_elements(shapes, 1) == {"P": 16 + 16 + 2, "Q": 8 + 16 + 16, "uncompressed": 34}
    assert powersgd_elements(shapes, 2) == {"P": 64, "Q": 48, "uncompressed": 34 + 32}
    assert powersgd_elements(shapes, 16) == {"P": 0, "Q": 0, "uncompressed": 450}
