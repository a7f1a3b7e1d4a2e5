"""What the instructor and the students of a class do on the hub, one small step each, every wait
bounded and named (the browser tests' style: tests/lab/browser/steps.py, whose steps are reused).

Each step goes through what a person sees and uses: the hub's login page, the Nbgrader menu, the
Formgrader's buttons and dialogs, the Assignments tab's buttons, a terminal.
"""

import re
import time

from browser.steps import exactly, hide_left_sidebar, menu

from .conftest import HUB_WAIT, new_page

try:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
except ImportError as missing:
    raise ImportError("Playwright is missing from .venv: run `make install`") from missing


def appear(locator, what, wait="step"):
    """Wait until `locator` is visible (HUB_WAIT[wait] seconds); fail naming `what`. Returns it."""
    try:
        locator.first.wait_for(state="visible", timeout=HUB_WAIT[wait] * 1000)
    except PlaywrightTimeout:
        raise AssertionError(f"{what} did not appear within {HUB_WAIT[wait]} s") from None
    return locator.first


def click(locator, what, wait="step"):
    """Click what a person would click, once it is there; fail naming it."""
    appear(locator, what, wait).click()


def until(page, check, what, wait):
    """Poll `check()` until it returns something true, and return it; fail naming `what`."""
    deadline = time.monotonic() + HUB_WAIT[wait]
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {HUB_WAIT[wait]} s")
        page.wait_for_timeout(250)


def log_in(browser, hub, user):
    """A user signs in on the hub's page (their server starts meanwhile); returns their page.
    `lab_ready(page, user)` waits for their JupyterLab."""
    page = new_page(browser)
    page.goto(f"{hub.url}/hub/login")
    appear(page.locator("#username_input"), "the hub's login form", "lab").fill(user)
    page.locator("#password_input").fill(hub.passwords[user])
    click(page.locator("#login_submit"), "the hub's Sign in button")
    return page


def lab_ready(page, user):
    """Wait until a user's JupyterLab shows their files (their server started and JupyterLab loaded)."""
    page.bring_to_front()
    appear(page.locator(".jp-DirListing-content"), f"{user}'s JupyterLab (their server started)", "spawn")
    return page


# ---- the instructor: the Formgrader panel (Nbgrader > Formgrader) ------------------------------------

def open_formgrader(page):
    hide_left_sidebar(page)
    menu(page, "Nbgrader", "Formgrader")
    formgrader = page.frame_locator("#formgrader-iframe iframe")
    appear(formgrader.locator("#main-table td.name"), "the Formgrader's list of assignments", "lab")
    return formgrader


def assignment_row(formgrader, assignment):
    name = formgrader.locator("td.name", has_text=exactly(assignment))
    return formgrader.locator("#main-table tr", has=name)


def formgrader_action(page, formgrader, assignment, column, what):
    """Click the button of `column` (assign, release, collect, generate-feedback, release-feedback) in the
    row of `assignment`, wait for nbgrader's dialog, and close it; returns the dialog's text.
    Fails if the dialog does not say it succeeded."""
    row = assignment_row(formgrader, assignment)
    click(row.locator(f"td.{column} a"), f"the Formgrader's {what} button of {assignment}")
    dialog = appear(formgrader.locator(".modal.in, .modal.show"), f"the Formgrader's dialog after {what}",
                    "exchange")
    text = dialog.inner_text()
    click(dialog.locator(".modal-footer button").last, f"the button that closes the {what} dialog")
    try:
        dialog.wait_for(state="hidden", timeout=HUB_WAIT["step"] * 1000)
    except PlaywrightTimeout:
        raise AssertionError(f"the {what} dialog did not close within {HUB_WAIT['step']} s") from None
    assert "Success" in text.split("\n")[:3] or text.lstrip("×\n ").startswith("Success"), \
        f"{what} of {assignment} did not succeed; the Formgrader said:\n{text[:3000]}"
    return text


def set_due_date(page, formgrader, assignment, when):
    """The Formgrader's pencil (Edit) of an assignment: a due date (UTC, to the second), then Save."""
    row = assignment_row(formgrader, assignment)
    click(row.locator("td.edit a"), f"the Formgrader's Edit button of {assignment}")
    dialog = appear(formgrader.locator("#edit-assignment-modal"), f"the dialog editing {assignment}")
    dialog.locator("input.modal-duedate").fill(time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(when)))
    dialog.locator("input.modal-timezone").fill("+0000")
    click(dialog.locator("button.save"), "the Save button of the Edit dialog")
    try:
        dialog.wait_for(state="hidden", timeout=HUB_WAIT["exchange"] * 1000)
    except PlaywrightTimeout:
        raise AssertionError(f"the Edit dialog did not close within {HUB_WAIT['exchange']} s") from None
    shown = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(when))
    until(page, lambda: shown in row.locator("td.duedate").inner_text(),
          f"the due date {shown} did not appear in the row of {assignment}", "step")


def submissions_count(formgrader, assignment):
    return assignment_row(formgrader, assignment).locator("td.num-submissions").inner_text().strip()


def close_dialog(formgrader, what):
    """Wait for the Formgrader's dialog, close it, return its text."""
    dialog = appear(formgrader.locator(".modal.in, .modal.show"), f"the Formgrader's dialog after {what}",
                    "autograde")
    text = dialog.inner_text()
    click(dialog.locator(".modal-footer button").last, f"the button that closes the {what} dialog")
    try:
        dialog.wait_for(state="hidden", timeout=HUB_WAIT["step"] * 1000)
    except PlaywrightTimeout:
        raise AssertionError(f"the {what} dialog did not close within {HUB_WAIT['step']} s") from None
    return text


def autograde_in_formgrader(formgrader, assignment, student):
    """The submissions of `assignment` (its count's link), then the Autograde button (the flash) of
    `student`'s row; returns the dialog's text once nbgrader says it succeeded."""
    click(assignment_row(formgrader, assignment).locator("td.num-submissions a"),
          f"the link to the submissions of {assignment}")
    student_id = formgrader.locator("td.student-id", has_text=exactly(student))
    row = formgrader.locator("#main-table tr", has=student_id)
    click(row.locator("td.autograde a"), f"the Autograde button of {student}'s submission")
    text = close_dialog(formgrader, f"autograding {student}")
    assert text.lstrip("×\n ").startswith("Success"), f"autograding {student} failed:\n{text[:3000]}"
    click(formgrader.locator(".breadcrumb a", has_text="Assignments"), "the Formgrader's Assignments link")
    appear(assignment_row(formgrader, assignment), "the Formgrader's list of assignments", "lab")
    return text


# ---- the instructor: a terminal ---------------------------------------------------------------------

def open_terminal(page):
    """A new terminal from the Launcher (File > New Launcher, then the Terminal card)."""
    menu(page, "File", "New Launcher")
    card = page.locator(".jp-LauncherCard:visible", has_text=exactly("Terminal"))
    click(card, "the Launcher's Terminal card")
    terminal = appear(page.locator(".jp-Terminal:visible"), "a terminal", "lab")
    appear(terminal.locator(".xterm-screen"), "the terminal's screen", "lab")
    return terminal


def type_in_terminal(page, terminal, line):
    terminal.click()
    page.keyboard.type(line)
    page.keyboard.press("Enter")


# ---- a student: the Assignments tab (Nbgrader > Assignment List) -------------------------------------

def open_assignments(page):
    menu(page, "Nbgrader", "Assignment List")
    panel = appear(page.locator("#assignments"), "the Assignments tab", "lab")
    return panel


def released(panel, assignment):
    return panel.locator("#released_assignments_list .list_item",
                         has=panel.page.locator(".item_name", has_text=exactly(assignment)))


def fetched(panel, assignment):
    return panel.locator("#fetched_assignments_list > .list_item",
                         has=panel.page.locator("a.assignment-notebooks-link", has_text=assignment))


def submitted(panel, assignment):
    return panel.locator("#submitted_assignments_list > .list_item",
                         has=panel.page.locator(".item_name", has_text=exactly(assignment)))


def fetch(panel, assignment):
    """Fetch a released assignment; returns its row among the downloaded ones."""
    click(released(panel, assignment).locator("button", has_text=exactly("Fetch")),
          f"the Fetch button of {assignment}", "exchange")
    return appear(fetched(panel, assignment), f"{assignment} among the downloaded assignments", "exchange")


def open_fetched_notebook(page, panel, assignment, notebook):
    """Unfold a downloaded assignment and open one of its notebooks (its link)."""
    row = fetched(panel, assignment)
    click(row.locator("a.assignment-notebooks-link"), f"the name of {assignment} (lists its notebooks)")
    link = row.locator(".assignment-notebooks .item_name a", has_text=exactly(notebook))
    click(link, f"the link to the notebook {notebook}")
    tab = page.locator(".lm-TabBar-tab.lm-mod-current", has_text=f"{notebook}.ipynb")
    appear(tab, f"the tab of {notebook}")
    appear(page.locator(".jp-StatusBar-Widget", has_text=re.compile(r"\|\s*Idle")),
           f"the kernel of {notebook} (status 'Idle')", "lab")


def submit(panel, assignment):
    """Press Submit; returns the timestamp nbgrader shows among the submitted assignments."""
    before = submitted_times(panel, assignment)
    click(fetched(panel, assignment).locator("button", has_text=exactly("Submit")),
          f"the Submit button of {assignment}", "exchange")
    return until(panel.page, lambda: next(iter(set(submitted_times(panel, assignment)) - set(before)), None),
                 f"a new submission of {assignment} did not appear among the submitted ones", "exchange")


def submitted_times(panel, assignment):
    rows = submitted(panel, assignment).locator(".nested_list_item .item_name")
    return [text.split("(")[0].strip() for text in rows.all_inner_texts()]


def fetch_feedback(panel, assignment):
    """Press Fetch Feedback; returns the '(view feedback)' link once it is there."""
    click(submitted(panel, assignment).locator("button", has_text=exactly("Fetch Feedback")),
          f"the Fetch Feedback button of {assignment}", "exchange")
    return appear(submitted(panel, assignment).locator("a", has_text="view feedback"),
                  f"the '(view feedback)' link of {assignment}", "exchange")


def open_feedback(page, link, notebook):
    """Follow '(view feedback)' (the file browser goes to the feedback's folder), open the notebook's
    feedback page, and return the frame that shows it."""
    link.click()
    sidebar = page.locator(".jp-SideBar.jp-mod-left .lm-TabBar-tab[data-id='filebrowser']")
    if "lm-mod-current" not in (sidebar.get_attribute("class") or ""):
        sidebar.click()
    item = page.locator(".jp-DirListing-item",
                        has=page.locator(".jp-DirListing-itemText", has_text=exactly(f"{notebook}.html")))
    appear(item, f"the feedback {notebook}.html in the file browser", "lab").dblclick()
    frame = page.frame_locator(".jp-HTMLViewer:visible iframe")
    appear(frame.locator("body"), f"the feedback page {notebook}.html", "lab")
    return frame
