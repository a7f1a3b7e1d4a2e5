"""pipeline.schedules: GPipe's order, the bubble formula against a simulation, memory, and bad schedules."""

import pytest

from dpcourse.topics.pipeline.schedules import (
    bubble_fraction,
    check_schedule,
    format_order,
    gpipe_schedule,
    idle_fraction,
    in_flight,
    parse_order,
    simulate,
)
from markers import chapter, exercise

# 1F1B on 3 stages, 5 micro-batches, written out by hand (warm-up 2, 1, 0 forwards)
ONE_F_ONE_B_3x5 = [parse_order("F0 F1 F2 B0 F3 B1 F4 B2 B3 B4"), parse_order("F0 F1 B0 F2 B1 F3 B2 F4 B3 B4"),
                   parse_order("F0 B0 F1 B1 F2 B2 F3 B3 F4 B4")]


@exercise("gpipe_step", "run_schedule")
def test_gpipe_runs_every_forward_then_every_backward_in_order():
    assert format_order(gpipe_schedule(3, 3, 1)) == "F0 F1 F2 B0 B1 B2"
    with pytest.raises(ValueError):
        gpipe_schedule(2, 3, 2)


@exercise("run_schedule")
@pytest.mark.parametrize("p, m", [(2, 1), (3, 4), (4, 8), (4, 2)])
def test_simulated_gpipe_idles_as_the_formula_says(p, m):
    timelines = simulate([gpipe_schedule(p, m, s) for s in range(p)], forward=1.0, backward=2.0)
    assert idle_fraction(timelines) == pytest.approx(bubble_fraction(p, m))
    assert max(e[3] for t in timelines for e in t) == pytest.approx((m + p - 1) * 3.0)


@chapter("pipeline_parallelism")
def test_one_f_one_b_has_gpipes_bubble_and_holds_p_minus_s():
    check_schedule(ONE_F_ONE_B_3x5, 5)
    assert idle_fraction(simulate(ONE_F_ONE_B_3x5, 1.0, 2.0)) == pytest.approx(bubble_fraction(3, 5))
    assert [in_flight(s) for s in ONE_F_ONE_B_3x5] == [3, 2, 1]
    assert [in_flight(gpipe_schedule(3, 5, s)) for s in range(3)] == [5, 5, 5]


@chapter("pipeline_parallelism")
def test_message_delays_lengthen_the_step():
    fast = idle_fraction(simulate(ONE_F_ONE_B_3x5, 1.0, 2.0))
    slow = idle_fraction(simulate(ONE_F_ONE_B_3x5, 1.0, 2.0, delay=0.5))
    assert slow > fast + 0.05


@chapter("pipeline_parallelism")
@pytest.mark.parametrize("schedules, message", [
    ([parse_order("F0 B0 F1 B1"), parse_order("F0 F1 B1 B0")], "its B actions are for micro-batches [1, 0]"),
    ([parse_order("F0 F1 B0 B1"), parse_order("B0 F0 F1 B1")], "B0 comes before F0"),
    ([parse_order("F0 F1 B0"), parse_order("F0 B0 F1 B1")], "its B actions are for micro-batches [0]"),
    ([parse_order("F0 B0 F1 B1"), parse_order("F0 F1 B0 B1")], "wait for each other in a circle"),
])
def test_bad_schedules_are_explained(schedules, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_schedule(schedules, 2)


@exercise("one_f_one_b", "run_schedule")
def test_parse_and_format_are_inverse():
    assert parse_order("F0 F1 B0 B1") == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert format_order(parse_order("F3 B12")) == "F3 B12"
