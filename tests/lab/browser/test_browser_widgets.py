"""Widgets in the browser: the ring replay of notebook 04 redraws when its slider moves."""

import shutil

import nbformat
import pytest

from markers import exercise

from .conftest import REPO
from .steps import (
    appear,
    code_cells,
    differ,
    menu,
    notebook,
    open_lab,
    open_notebook,
    picture,
    run_cell,
    select_cell,
    settle,
    unexpected_errors,
    until,
)

RING = "04_ring_allreduce/04_ring_allreduce.ipynb"
REPLAY = "ring_explorer(record_ring(ring_all_reduce"  # the cell drawing the replay of the whole all-reduce
HEADING = "Your all-reduce, replayed"  # the text above it


@pytest.fixture
def ring_written(tmp_path):
    """A learner's course whose notebook 04 has a working ring (the solution notebook): the released
    one only replays the ring once the learner's ring works."""
    root = tmp_path / "course"
    (root / "04_ring_allreduce").mkdir(parents=True)
    shutil.copy(REPO / "solutions" / RING, root / RING)
    return root


def code_index(path, text):
    """Index of the first code cell whose source contains `text`."""
    cells = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    return next(i for i, c in enumerate(cells) if text in c.source)


@exercise("ring_all_reduce")
def test_ring_replay_redraws_when_its_slider_moves(start_server, page, shots, ring_written):
    server = start_server("lab", make_vars=[f"LAB_ROOT={ring_written}"])
    open_lab(page, server)
    open_notebook(page, RING)
    replay = code_index(ring_written / RING, REPLAY)
    before = [c["prompt"] for c in code_cells(page)]
    select_cell(page, replay)
    menu(page, "Run", "Run All Above Selected Cell")
    cells = settle(page, before, "the cells above the ring replay")
    cells[replay] = run_cell(page, replay)
    errors = unexpected_errors(cells[:replay + 1], lambda i, error: False)
    assert not errors, f"notebook 04 with a working ring fails before its replay: {errors}"

    cell = notebook(page).locator(".jp-CodeCell").nth(replay)
    output = cell.locator(".jp-Cell-outputArea")
    image = output.locator("img")
    appear(image, "the ring replay's picture", "widget")
    slider = output.locator(".widget-slider")
    readout = slider.locator(".widget-readout")
    heading = notebook(page).locator(".jp-MarkdownCell", has_text=HEADING)
    heading.evaluate("cell => cell.scrollIntoView()")  # the replay under its heading, nothing above
    shots(page, "notebook-widget")
    first, first_src, first_step = picture(output), image.get_attribute("src"), readout.inner_text()

    appear(slider.locator(".noUi-handle"), "the handle of the replay's step slider").focus()
    page.keyboard.press("ArrowRight")
    until(page, lambda: readout.inner_text() != first_step, "the slider's readout did not change", "widget")
    try:
        until(page, lambda: image.count() == 1 and image.get_attribute("src") not in (None, first_src),
              f"the ring replay did not redraw after its slider moved from step {first_step}", "widget")
    except AssertionError as missing:
        raise AssertionError(f"{missing}; the widget shows: {output.inner_text()[-500:]}") from None
    after = picture(output)
    shots(output, "ring-replay")
    assert differ(first, after), \
        f"the ring replay looks the same at steps {first_step} and {readout.inner_text()}"

