"""dpcourse.viz: the widget helper, the timeline helper and the text tables every topic module uses."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from dpcourse.topics.data_parallel.costs import dataparallel_traffic, print_traffic  # noqa: E402
from dpcourse.viz.tables import print_table  # noqa: E402
from dpcourse.viz.timelines import Span, draw_timeline  # noqa: E402
from dpcourse.viz.widgets import explorer  # noqa: E402
from markers import exercise  # noqa: E402


def test_print_table_aligns_and_leaves_out_an_empty_header(capsys):
    print_table([(0, 12), (1, 3)], [("rank", 4), ("bytes", 6)], "traffic")
    print_table([("a", "1.0 MB")], [("", -3), ("", 8)], indent="  ")
    assert capsys.readouterr().out.splitlines() == [
        "traffic", "rank  bytes", "   0     12", "   1      3", "  a     1.0 MB"]


@exercise("mini_data_parallel")
def test_dataparallel_traffic_table_adds_the_total_through_device_0(capsys):
    print_traffic(dataparallel_traffic(1e6, 2e6, 1e5, devices=2), "two devices")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "two devices" and len(lines) == 1 + 6 + 1
    assert lines[-1].startswith("  DataParallel, all through device 0") and lines[-1].endswith("3.1 MB")


def test_timeline_rows_come_in_groups_top_down():
    _, ax = plt.subplots()
    ys = draw_timeline(ax, [["a", "b"], ["c"]], [Span(0, 0, 1, "red", "x"), Span(2, 1, 3, "blue")],
                       ticks=[(1, 0.5, "black")], xlabel="ms")
    assert ys == [0.0, 1.0, 2.4] and [t.get_text() for t in ax.get_yticklabels()] == ["a", "b", "c"]
    assert ax.get_ylim()[0] > ax.get_ylim()[1]  # the first row at the top
    plt.close("all")


def test_explorer_redraws_when_a_control_moves():
    import ipywidgets as widgets

    seen = []
    slider = widgets.IntSlider(value=1, min=0, max=3)
    box = explorer({"step": slider}, lambda step: seen.append(step), play="step")
    assert isinstance(box.children[0].children[0], widgets.Play)
    slider.value = 2
    assert seen[-1] == 2
