"""What a person does in JupyterLab, one small step each, every wait bounded and named.

Steps go through what a person sees and uses (the file browser, menus, a cell's editor, toolbar
buttons, dialogs, a widget's slider), never through JupyterLab's internals: a test then fails where
a learner or an instructor would be stuck, with a message saying what did not appear.
"""

import io
import re
import time

from PIL import Image, ImageChops

try:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
except ImportError as missing:
    raise ImportError("Playwright is missing from .venv: run `make install` (requirements.txt names it)"
                      ) from missing

from .conftest import WAIT

ERROR = "Traceback (most recent call last)"  # the header of every exception a cell shows


def appear(locator, what, wait="step"):
    """Wait until `locator` is visible; fail naming `what` (not a CSS selector) and the wait.
    Returns its first match."""
    try:
        locator.first.wait_for(state="visible", timeout=WAIT[wait] * 1000)
    except PlaywrightTimeout:
        raise AssertionError(f"{what} did not appear within {WAIT[wait]} s") from None
    return locator.first


def click(locator, what, wait="step"):
    """Click what a person would click, once it is there; fail naming it."""
    appear(locator, what, wait).click()


def until(page, check, what, wait):
    """Poll `check()` until it returns something true, and return it; fail naming `what`."""
    deadline = time.monotonic() + WAIT[wait]
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {WAIT[wait]} s")
        page.wait_for_timeout(250)


def exactly(text):
    """A pattern matching `text` alone: "Run All Cells" must not pick "Restart Kernel and Run All Cells…"."""
    return re.compile(rf"^\s*{re.escape(text)}\s*$")


def open_lab(page, server):
    """Open JupyterLab with the server's token, as the address `make lab` prints."""
    page.goto(server.url("lab"))
    appear(page.locator(".jp-DirListing-content"), "JupyterLab's file browser", "lab")


def menu(page, top, item):
    """Click a menu of the menu bar, then one of its items (labels as a person reads them)."""
    click(page.locator(".lm-MenuBar-itemLabel", has_text=exactly(top)), f"the {top} menu")
    label = page.locator(".lm-Menu-itemLabel", has_text=exactly(item))
    entry = appear(page.locator(".lm-Menu-item", has=label), f"the item {item!r} of the {top} menu")
    if "lm-mod-disabled" in (entry.get_attribute("class") or ""):
        page.keyboard.press("Escape")
        raise AssertionError(f"the item {item!r} of the {top} menu is disabled")
    entry.click()


def hide_left_sidebar(page):
    """Fold the file browser away (click its tab), leaving the main area the whole width."""
    tab = page.locator(".jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current")
    click(tab, "the left sidebar's open tab")
    try:
        page.locator(".jp-FileBrowser").wait_for(state="hidden", timeout=WAIT["step"] * 1000)
    except PlaywrightTimeout:
        raise AssertionError(f"the file browser did not fold away within {WAIT['step']} s") from None


def open_path(page, path):
    """Open folders and then a file from the file browser by double-clicks, as a person does."""
    for name in path.split("/"):
        item = page.locator(".jp-DirListing-item",
                            has=page.locator(".jp-DirListing-itemText", has_text=exactly(name)))
        appear(item, f"{name} in the file browser").dblclick()


def open_notebook(page, path):
    """Open a notebook from the file browser; return its panel once its kernel is idle."""
    open_path(page, path)
    name = path.split("/")[-1]
    appear(page.locator(".lm-TabBar-tab.lm-mod-current", has_text=name), f"the tab of {name}")
    panel = notebook(page)
    appear(panel.locator(".jp-CodeCell"), f"the code cells of {name}")
    appear(page.locator(".jp-StatusBar-Widget", has_text=re.compile(r"\|\s*Idle")),
           f"the kernel of {name} (status 'Idle')", "lab")
    return panel


def notebook(page):
    """The notebook panel in front."""
    return page.locator(".jp-NotebookPanel:visible")


def code_cells(page):
    """What each code cell of the notebook in front shows: prompt, printed text, error (if any)."""
    return notebook(page).locator(".jp-CodeCell").evaluate_all("""(cells, header) => cells.map(cell => {
        const text = mime => Array.from(cell.querySelectorAll(
            `.jp-OutputArea-output[data-mime-type="${mime}"]`)).map(o => o.innerText).join("\\n");
        const stderr = text("application/vnd.jupyter.stderr");
        return {prompt: cell.querySelector(".jp-InputArea-prompt").innerText.trim(),
                text: text("application/vnd.jupyter.stdout") + text("text/plain"),
                error: stderr.includes(header) ? stderr : ""};
    })""", ERROR)


def has_run(cell):
    return re.fullmatch(r"\[\d+\]:", cell["prompt"]) is not None


def settle(page, before, what):
    """Wait until the cells started after the state `before` have finished (no [*] prompt left)."""
    def done():
        cells = code_cells(page)
        running = any("*" in c["prompt"] for c in cells)
        return cells if not running and [c["prompt"] for c in cells] != before else None
    return until(page, done, f"{what} did not finish", "cells")


def select_cell(page, index):
    """Select the index-th code cell (command mode), by clicking its prompt."""
    click(notebook(page).locator(".jp-CodeCell").nth(index).locator(".jp-InputPrompt"),
          f"the prompt of code cell {index}")


def run_all_cells(page):
    """Run > Run All Cells; after a cell that fails, go on from the next cell, as a learner who reads
    the error and runs on would (JupyterLab stops a run at the first error). Returns the code cells."""
    before = [c["prompt"] for c in code_cells(page)]
    menu(page, "Run", "Run All Cells")
    for _ in range(len(before)):
        cells = settle(page, before, "running the notebook's cells")
        not_run = [i for i, c in enumerate(cells) if not has_run(c)]
        if not not_run:
            return cells
        before = [c["prompt"] for c in cells]
        select_cell(page, not_run[0])
        if not_run[0] == len(cells) - 1:  # JupyterLab disables "... and All Below" on the last cell
            page.keyboard.press("Control+Enter")
        else:
            menu(page, "Run", "Run Selected Cell and All Below")
    raise AssertionError(f"cells still not run after {len(before)} tries: {[c['prompt'] for c in cells]}")


def run_cell(page, index):
    """Run one code cell in place (Ctrl+Enter) and return what it shows."""
    before = [c["prompt"] for c in code_cells(page)]
    select_cell(page, index)
    page.keyboard.press("Control+Enter")
    return settle(page, before, f"code cell {index}")[index]


def unexpected_errors(cells, expected):
    """The errors of cells that `expected(index, error)` does not allow, as readable lines."""
    return [f"code cell {i} ({c['prompt']}) shows: {first_line(c['error'])}"
            for i, c in enumerate(cells) if c["error"] and not expected(i, c["error"])]


def first_line(error):
    """The exception line of a traceback as a cell shows it (ename: evalue)."""
    lines = [line for line in error.splitlines() if re.match(r"^\w*(Error|Exception|Interrupt)\b", line)]
    return lines[-1] if lines else error.strip().splitlines()[-1]


def replace_line(page, index, old, new):
    """Type `new` over the line holding `old` in a code cell's editor, as a learner would: click the
    line's end, select back to its indentation, type. Returns the editor's text afterwards."""
    editor = notebook(page).locator(".jp-CodeCell").nth(index).locator(".cm-content")
    click(editor.locator(".cm-line", has_text=old), f"the line {old!r} in code cell {index}")
    page.keyboard.press("End")
    page.keyboard.press("Shift+Home")
    page.keyboard.type(new)
    page.keyboard.press("Escape")  # back to command mode
    return editor.inner_text()


def validate(page, shots):
    """Press nbgrader's Validate button; return the dialog's verdict class and text, then close it.

    The verdict class is nbgrader's: validation-failed, validation-success, validation-changed, ...
    """
    click(notebook(page).locator(".validate-button"), "nbgrader's Validate button in the notebook toolbar")
    dialog = page.locator(".jp-Dialog", has=page.locator(".jp-Dialog-header", has_text="Validation Results"))
    appear(dialog, "the Validate dialog ('Validation Results')", "validate")
    message = dialog.locator("#validation-message")
    verdict = [c for c in message.get_attribute("class").split() if c.startswith("validation-")]
    text = message.inner_text()
    shots(dialog.locator(".jp-Dialog-content"), "validate-dialog")
    click(dialog.locator(".jp-mod-accept"), "the Validate dialog's Ok button")
    try:
        dialog.wait_for(state="detached", timeout=WAIT["step"] * 1000)
    except PlaywrightTimeout:
        raise AssertionError(f"the Validate dialog did not close within {WAIT['step']} s") from None
    return (verdict[0] if verdict else "none"), text


def picture(locator):
    """A screenshot of an element, as a PIL image."""
    return Image.open(io.BytesIO(locator.screenshot())).convert("RGB")


def differ(a, b):
    """True if two pictures differ in at least one pixel."""
    return a.size != b.size or ImageChops.difference(a, b).getbbox() is not None
