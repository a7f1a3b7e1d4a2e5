"""ringtrace: a recorded ring replays step by step from what the ranks really did (the textbook ring of
notebook 04, as dpgrader.ring_allreduce.tuned writes it)."""

import matplotlib

from dpcourse.topics.collectives.ringtrace import RingReplay, record_ring
from dpgrader.ring_allreduce.tuned import textbook_reduce_scatter, textbook_ring_all_reduce
from markers import exercise

matplotlib.use("Agg")


@exercise("ring_reduce_scatter", "ring_all_gather", "ring_all_reduce")
def test_a_ring_all_reduce_replays_its_steps_and_ends_complete():
    replay = RingReplay(record_ring(textbook_ring_all_reduce, 3, 5))
    assert replay.steps == 4 and replay.complete()
    assert replay.chunks == [(0, 2), (2, 4), (4, 5)]
    for rank in range(3):  # before the first step each rank holds only its own data
        assert replay.contributions(0, rank) == [[rank]] * 5
    first = replay.messages(0)
    assert [(m["src"], m["dst"]) for m in first] == [(0, 1), (1, 2), (2, 0)]
    assert [replay.chunk_name(m["span"]) for m in first] == ["chunk 2", "chunk 0", "chunk 1"]
    # the reduce-scatter received into a separate buffer: the arrival is matched to the send's chunk
    assert [m["arrives"] for m in first] == [m["span"] for m in first]
    # after the reduce-scatter (before step 3) rank r holds every rank's data in chunk r
    for rank in range(3):
        a, b = replay.chunks[rank]
        assert replay.contributions(2, rank)[a:b] == [[0, 1, 2]] * (b - a)
    assert "every element on every rank holds all ranks' data" in replay.caption(replay.steps)
    # the slider's value (steps done) and the title say the same number
    assert replay.caption(2).startswith(f"after 2 of {replay.steps} steps; step 3 sends ")
    for step in range(replay.steps + 1):
        replay.draw(step)
    matplotlib.pyplot.close("all")


@exercise("ring_reduce_scatter")
def test_a_ring_without_its_all_gather_is_shown_incomplete():
    replay = RingReplay(record_ring(textbook_reduce_scatter, 4, 8))
    assert replay.steps == 3 and not replay.complete()
    assert [replay.complete_chunks(r) for r in range(4)] == [[0], [1], [2], [3]]
    assert "complete chunks -- rank 0: 0; rank 1: 1; rank 2: 2; rank 3: 3" in replay.caption(3)
