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


def _run(rank, n, ops=(), **values):
    """What the case runner gives a check of one rank's attention call (comm.cases.RankRun)."""
    from dpcourse.comm.cases import RankRun

    reported = {"output": None, "flops_at": [], "flops": 0, "peak": 0, "most_alive": {}, **values}
    return RankRun(rank, tuple(range(n)), values=reported, ops=list(ops))


def _runs(case, n, outputs, ops=None, **fields):
    from dpcourse.topics.sequence.runs import case_positions

    positions = case_positions(case, n)
    return [_run(rank, n, ops[rank] if ops else (), positions=positions[rank], output=outputs[rank],
                 **{name: values[rank] for name, values in fields.items()}) for rank in range(n)]


def test_a_nan_from_a_block_the_mask_hides_is_not_called_an_overflow():
    from dpcourse.topics.sequence.checks import expect_ring_values

    case = dict(shape=(1, 1, 8, 2), seeds=(1, 2, 3), positions="contiguous", causal=True, scale=30.0)
    right = reference_rows(case, 4)
    # rank 0's queries (positions 0, 1) see none of rank 3's keys: a ring that computed that block for them
    hidden = [r.clone() for r in right]
    hidden[0][..., :, :] = float("nan")
    message = (r"rank 0's output holds inf or nan \(first at query position 0, which sees none of the keys "
               r"of rank 1's block \(positions 2-3\)\): a block the causal mask hides entirely")
    with pytest.raises(AssertionError, match=message):
        expect_ring_values(_runs(case, 4, hidden), case, "ring_attention")
    # every query, the last rank's too (it sees keys of every block): exp() of large scores overflowed
    overflow = [torch.full_like(r, float("nan")) for r in right]
    with pytest.raises(AssertionError, match=r"also at position 6, which sees keys of every block.*"
                                             r"exp\(\) of large scores overflowed"):
        expect_ring_values(_runs(case, 4, overflow), case, "ring_attention")


def test_the_transfer_must_be_posted_before_the_first_block_is_computed():
    from dpcourse.comm.recorder import CommOp
    from dpcourse.topics.sequence.checks import expect_transfers_posted_first

    case = dict(shape=(1, 1, 4, 2), positions="contiguous", causal=False)
    ops = [[CommOp("send", 1, 64, 0, 0, (0, 1)), CommOp("recv", 1, 64, 0, 0, (0, 1))]] * 2
    expect_transfers_posted_first(_runs(case, 2, [None, None], ops=ops, flops_at=[[0, 0], [0, 0]],
                                        flops=[32, 32]), "ring")
    with pytest.raises(AssertionError, match=r"rank 1 did 16 FLOPs of attention \(of its 32\) before posting "
                                             r"the send and the receive of step 0"):
        expect_transfers_posted_first(_runs(case, 2, [None, None], ops=ops, flops_at=[[0, 0], [16, 16]],
                                            flops=[32, 32]), "ring")


def test_the_memory_message_counts_blocks_and_names_keeping_only_when_it_is_so():
    from dpcourse.topics.sequence.checks import expect_flat_memory

    block = 100
    alone = [_run(0, 1, peak=1000, most_alive={block: 1})]
    ring = [_run(r, 6, peak=1000 + 250, most_alive={block: 3}) for r in range(6)]
    expect_flat_memory(alone, ring, "ring", block)  # 2.5 blocks more: the block arriving and one sent
    stale = [_run(r, 6, peak=1000 + 360, most_alive={block: 4}) for r in range(6)]
    message = (r"grew by 360 bytes \(3.6 K/V blocks of 100 bytes\) from 1 rank to 6.*up to 4 tensors of a "
               r"K/V block's size at once \(1 alone\).*a block of an earlier step is still alive")
    with pytest.raises(AssertionError, match=message):
        expect_flat_memory(alone, stale, "ring", block)
    kept = [_run(r, 6, peak=1000 + 460, most_alive={block: 5}) for r in range(6)]
    with pytest.raises(AssertionError, match="it keeps the blocks it received"):
        expect_flat_memory(alone, kept, "ring", block)


def test_a_right_result_in_float32_is_told_by_its_dtype():
    from dpcourse.checks.tensors import expect_tensor

    want = torch.linspace(0, 1, 12, dtype=torch.float64)
    message = r"out has dtype torch.float32, expected torch.float64: its values are right to torch.float32's"
    with pytest.raises(AssertionError, match=message):
        expect_tensor(want.float(), want, "out")
    with pytest.raises(AssertionError, match=r"out is tensor"):
        expect_tensor((want + 1).float(), want, "out")


def test_a_wrong_ulysses_output_says_where_it_first_differs_and_whose_row_it_holds():
    from dpcourse.topics.sequence.checks import expect_ulysses

    case = dict(shape=(2, 4, 8, 4), seeds=(1, 2, 3), positions="contiguous", causal=False)
    right = reference_rows(case, 2)
    swapped = [right[0].flip(1), right[1]]  # rank 0's heads in reverse order: the values print alike
    message = (r"rank 0's output \(its queries, positions 0-3\) is wrong: first wrong at batch 0, head 0, "
               r"position 0: .* -- that row is the expected row of batch 0, head 3, position 0: a piece in "
               r"the wrong place")
    with pytest.raises(AssertionError, match=message):
        expect_ulysses(_runs(case, 2, swapped), case, "ulysses")
