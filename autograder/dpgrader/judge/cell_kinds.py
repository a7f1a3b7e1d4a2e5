"""What kind of notebook cell this is, by its nbgrader metadata and tags.

Kept apart from learner.py (which imports torch) so that nbgrader's own processes, which load
steps.py through nbgrader_config.py, start without importing torch.
"""


def nbgrader_meta(cell):
    return cell.metadata.get("nbgrader", {})


def is_graded_test(cell):
    meta = nbgrader_meta(cell)
    return cell.cell_type == "code" and bool(meta.get("grade")) and not meta.get("solution")


def is_demo(cell):
    return "demo" in cell.metadata.get("tags", [])
