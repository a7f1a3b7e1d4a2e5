"""dpcourse.topics.sequence.checks without ranks: the ring written out, its known mistakes, the work a
causal split needs, and the messages of the positions check."""

import pytest
import torch

from dpcourse.topics.sequence.checks import (
    expect_balanced_pairs,
    expect_positions,
    needed_flops,
    reference_rows,
    ring_mistakes,
    simulate,
)
from dpcourse.topics.sequence.models import contiguous_positions, head_tail_positions
from markers import exercise

pytestmark = exercise("ring_attention", "balanced_positions")

CASES = [dict(shape=(1, 2, 10, 4), seeds=(1, 2, 3), positions=split, causal=causal, scale=scale)
         for split in ("contiguous", "balanced") for causal in (False, True) for scale in (1.0, 30.0)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['positions']}-causal{c['causal']}-x{c['scale']:g}")
def test_the_ring_written_out_is_full_attention_and_its_known_mistakes_differ_from_it(case):
    for n in (2, 3):
        expected = reference_rows(case, n)
        for rank in range(n):
            assert torch.allclose(simulate(case, n, rank), expected[rank], atol=1e-10)
        if n == 2:
            continue  # on 2 ranks, "the wrong way round" is the right way
        # the last rank of a contiguous causal split needs every block: each mistake shows there
        last = n - 1
        for wrong, why in ring_mistakes(case, n, last):
            assert wrong.shape == expected[last].shape, why
            if case["scale"] == 1.0 and (case["positions"] == "contiguous" or not case["causal"]):
                assert not torch.allclose(wrong, expected[last]), why


def test_causal_work_needed_per_rank_contiguous_against_balanced():
    case = dict(shape=(1, 1, 16, 2), positions="contiguous", causal=True)
    per_rank = needed_flops(case, 4)
    # rank r computes r full blocks of 4 x 4 pairs and its diagonal block, 4 FLOPs per pair and d_head
    assert per_rank == [4 * 1 * 1 * 4 * 4 * 2 * (r + 1) for r in range(4)]
    balanced = needed_flops(dict(case, positions="balanced"), 4)
    assert len(set(balanced)) == 1 and sum(balanced) < 4 * 16 * 16 * 2 * 4


def test_the_positions_check_names_the_rank_and_the_mistake():
    expect_positions(head_tail_positions(10, 3), 10, 3, "balanced_positions(10, 3)")
    pieces = r"\(.*: 0-1, 2-3, 4-5, 6-7, 8, 9\): 0, 1, 9 -- the contiguous"
    with pytest.raises(AssertionError, match=r"rank 0 holds 0-3, expected pieces 0 and 5 of 6 " + pieces):
        expect_positions(contiguous_positions(10, 3), 10, 3, "balanced_positions(10, 3)")
    unsorted = [torch.cat((p[len(p) // 2:], p[:len(p) // 2])) for p in head_tail_positions(8, 2)]
    with pytest.raises(AssertionError, match="not ascending"):
        expect_positions(unsorted, 8, 2, "balanced_positions(8, 2)")
    with pytest.raises(AssertionError, match="1-D int64"):
        expect_positions([p.float() for p in head_tail_positions(8, 2)], 8, 2, "balanced_positions(8, 2)")


def test_balanced_pairs_accepts_the_head_tail_split_and_refuses_the_contiguous_one():
    expect_balanced_pairs(head_tail_positions(64, 4), 64, "head-tail")
    with pytest.raises(AssertionError, match=r"rank 3's queries have .* causal \(query, key\) pairs"):
        expect_balanced_pairs(contiguous_positions(64, 4), 64, "contiguous")
