"""collective_pictures and maskpics: every collective run for real, its colours read off 2**rank sums."""

import matplotlib
import torch

from dpcourse.topics.collectives.pictures import COLLECTIVES, collect, draw
from dpcourse.viz.colours import ranks_in
from markers import chapter

matplotlib.use("Agg")


def test_masks_name_the_contributing_ranks():
    assert ranks_in(13.0, 4) == [0, 2, 3]
    assert ranks_in(1.0, 1) == [0]
    assert ranks_in(16.0, 4) is None and ranks_in(2.5, 4) is None and ranks_in(0.0, 4) is None


@chapter("collectives")
def test_every_collective_runs_and_is_drawn():
    results = collect(3)
    values = {name: [r[name][0] for r in results] for name in COLLECTIVES}
    masks = {name: [r[name][1] for r in results] for name in COLLECTIVES}
    total = sum(torch.arange(3.0) + 10 * r for r in range(3))
    assert all(torch.equal(after[0], total) for _, after in values["all_reduce"])
    assert [after[0].tolist() for _, after in values["reduce_scatter"]] == [[30.0], [33.0], [36.0]]
    assert all(after[0].tolist() == [7.0] for _, after in masks["reduce_scatter"])  # ranks 0+1+2
    assert values["reduce"][1][1] == [None]  # undefined off the root
    assert [after[0].tolist() for _, after in masks["all_to_all"]] == [[1.0, 2.0, 4.0]] * 3
    for name in COLLECTIVES:
        draw(results, name)
    matplotlib.pyplot.close("all")
