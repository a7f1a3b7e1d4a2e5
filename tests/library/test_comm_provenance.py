"""comm.provenance: the replays of how a case's values were reached, on hand-made router records -- sums
at the same positions (messages and collectives), copies from anywhere, and values a rank may compute once
it knows their inputs. Each rule is shown both ways: an honest record passes, a made-up one (zeros) fails."""

import pytest
import torch

from dpcourse.comm.cases import RankRun
from dpcourse.comm.provenance import Copies, Sums, deliveries
from dpcourse.comm.recorder import CommOp


def post(src, dst, message, tensor):
    return [("post", src, dst, message, tensor), ("deliver", src, dst, message, tensor)]


def collective(name, group, payloads):
    ops = {}
    for rank, tensors in payloads.items():
        record = CommOp(name, None, 0, 0.0, 0.0, tuple(group))
        record.payload = tensors
        ops[rank] = record
    return [("collective", tuple(group), ops)]


def runs_with(**values_per_rank):
    return [RankRun(int(rank), (0, 1), values=values) for rank, values in sorted(values_per_rank.items())]


INPUTS = [torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([10.0, 20.0, 30.0, 40.0])]


def test_sums_accept_a_ring_exchange_and_refuse_a_made_up_message():
    events = post(0, 1, 0, INPUTS[0][2:]) + post(1, 0, 1, INPUTS[1][:2])
    Sums(INPUTS).check([], events, "swap")
    with pytest.raises(AssertionError, match="rank 0: swap sent rank 1 a message .* not made of data rank 0"):
        Sums(INPUTS).check([], post(0, 1, 0, torch.zeros(2)), "swap")
    with pytest.raises(AssertionError, match="not made of data rank 0 had"):  # rank 1's data, never received
        Sums(INPUTS).check([], post(0, 1, 0, INPUTS[1][:2]), "swap")


def test_sums_replay_an_all_reduce_and_check_the_final_values():
    total = INPUTS[0] + INPUTS[1]
    events = collective("all_reduce", [0, 1], {0: [INPUTS[0]], 1: [INPUTS[1]]})
    Sums(INPUTS, finals=("output",)).check(runs_with(**{"0": {"output": total}, "1": {"output": total}}),
                                            events, "g")
    with pytest.raises(AssertionError, match="rank 1: g put into its all_reduce a tensor .* not made of"):
        zeros = collective("all_reduce", [0, 1], {0: [INPUTS[0]], 1: [torch.zeros(4)]})
        Sums(INPUTS).check([], zeros, "g")
    alone = collective("all_reduce", [0, 1], {0: [torch.zeros(4) + INPUTS[0]], 1: [INPUTS[1]]})
    with pytest.raises(AssertionError, match="rank 0: g: output holds, at element 0, a value"):
        Sums(INPUTS, finals=("output",)).check(runs_with(**{"0": {"output": total * 2}}), alone, "g")


def test_sums_take_several_inputs_of_a_rank_end_to_end():
    inputs = [[torch.ones(2), torch.full((3,), 5.0)], [torch.full((2,), 2.0), torch.full((3,), 7.0)]]
    events = collective("all_reduce", [0, 1], {0: [inputs[0][1]], 1: [inputs[1][1]]})
    Sums(inputs).check([], events, "f backward")  # the second input (a gradient), at its own offset


def test_deliveries_follow_the_collectives_layouts():
    payloads = {0: ["a0", "a1"], 1: ["b0", "b1"]}
    assert sorted(deliveries("all_to_all", [0, 1], payloads)) == [(0, 0, 0), (0, 1, 0), (1, 0, 1), (1, 1, 1)]
    assert len(deliveries("all_gather", [0, 1], {0: ["a"], 1: ["b"]})) == 4


Q = [torch.tensor([0.25, 0.5]), torch.tensor([0.75, 1.5])]


def test_copies_accept_data_from_anywhere_once_received_and_refuse_zeros():
    events = post(1, 0, 0, Q[1].flip(0)) + post(0, 1, 1, torch.cat([Q[0], Q[1][:1]]))  # passes rank 1's on
    Copies(Q).check([], events, "ring")
    with pytest.raises(AssertionError, match="rank 0: ring sent rank 1 a message"):
        Copies(Q).check([], post(0, 1, 0, torch.zeros(2)), "ring")
    with pytest.raises(AssertionError, match="rank 0: ring sent"):  # rank 1's value before it arrived
        Copies(Q).check([], post(0, 1, 0, Q[1][:1]), "ring")
    Copies(Q).check([], post(0, 1, 0, torch.tensor([3, 4])), "ring")  # integers (indices) are no data


def test_a_derived_value_is_known_once_its_inputs_are():
    result = torch.tensor([9.125])  # what rank 0 may compute once it has rank 1's first element
    derived = [[({0: torch.tensor([True, False]), 1: torch.tensor([True, False])}, result)], []]
    runs = runs_with(**{"0": {"output": result}})
    Copies(Q, derived=derived, finals=("output",)).check(runs, post(1, 0, 0, Q[1][:1]), "attention")
    with pytest.raises(AssertionError, match="rank 0: attention: output holds, at element 0"):
        Copies(Q, derived=derived, finals=("output",)).check(runs, [], "attention")
    known_at_once = [[(None, result)], []]
    Copies(Q, derived=known_at_once).check([], post(0, 1, 0, result), "topk")
