"""The learner's side of a submission, as the judge sees it: their program, and stand-ins for its names.

The judge never runs the learner's code in its own process. It reads the submission's code cells
(the learner's program: solution cells, cells the learner added, and the read-only setup cells
nbgrader restored), lists the names the learner defines, and puts a `LearnerProxy` in place of
each. A proxy passed to `launch` (inside a function or as an argument) travels by name and
resolves, inside each sandboxed rank, to what the learner's program defined there. A proxy
called directly runs the call in a one-rank sandboxed launch and returns its plain result;
tensors and modules given as arguments get back what the call did to them (in-place updates).
"""

import ast
import builtins
import json
from types import SimpleNamespace

import torch

from dpcourse import launch
from dpcourse.grading.zygote import LearnerName, call_learner
from dpcourse.runtime import launcher
from dpgrader.judge.cell_kinds import is_demo, is_graded_test, nbgrader_meta  # noqa: F401 - used here and by cells.py


def learner_exception(name, message):
    """The learner's exception, as the test cell would have seen it in their kernel: the builtin
    type when it is one (NotImplementedError, ValueError ...), else a look-alike of that name."""
    kind = getattr(builtins, name, None)
    if not (isinstance(kind, type) and issubclass(kind, Exception)):
        kind = type(name, (Exception,), {"__module__": "learner"})
    try:
        return kind(message)
    except Exception:  # noqa: BLE001 - an exception type whose constructor wants more
        return type(name, (Exception,), {"__module__": "learner"})(message)


def read_notebook(path):
    """A notebook's cells (cell_type, source as one string, metadata), read as plain JSON.

    Not nbformat: importing it costs ~2.5 s here (jsonschema's URI grammar), more than the
    whole judgement of a small notebook; nbgrader has validated the file already.
    """
    with open(path) as f:
        data = json.load(f)
    cells = []
    for cell in data.get("cells", []):
        source = cell.get("source", "")
        cells.append(SimpleNamespace(cell_type=cell.get("cell_type"), metadata=cell.get("metadata", {}),
                                     source="".join(source) if isinstance(source, list) else source))
    return SimpleNamespace(cells=cells)


def restore_locked(submission, source):
    """The submission with its read-only cells as the instructor wrote them (matched by grade id),
    as nbgrader's autograde restores them before running a notebook: an edited setup cell does not
    change what the learner's program is."""
    locked = {nbgrader_meta(cell).get("grade_id"): cell for cell in source.cells
              if nbgrader_meta(cell).get("locked") and not nbgrader_meta(cell).get("solution")}
    cells = []
    for cell in submission.cells:
        original = locked.get(nbgrader_meta(cell).get("grade_id"))
        cells.append(cell if original is None or original.cell_type != cell.cell_type else original)
    return SimpleNamespace(cells=cells)


def program_cells(submission):
    """The learner's program: every code cell but graded tests and demos, in notebook order."""
    return [cell.source for cell in submission.cells
            if cell.cell_type == "code" and not is_graded_test(cell) and not is_demo(cell)]


def defined_names(submission, source):
    """Names defined at top level by the learner's own cells (solution cells and added cells)."""
    instructor = {cell.source for cell in source.cells
                  if cell.cell_type == "code" and not nbgrader_meta(cell).get("solution")}
    names = set()
    for cell in submission.cells:
        if cell.cell_type != "code" or is_graded_test(cell) or is_demo(cell):
            continue
        if not nbgrader_meta(cell).get("solution") and cell.source in instructor:
            continue
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def solution_names(source):
    """Names the instructor's solution cells define: a learner who deleted one still gets a proxy
    (whose use then fails with NameError inside the rank, as it would in their notebook)."""
    names = set()
    for cell in source.cells:
        if cell.cell_type == "code" and nbgrader_meta(cell).get("solution"):
            try:
                tree = ast.parse(cell.source)
            except SyntaxError:
                continue
            names.update(node.name for node in tree.body
                         if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))
    return names


class LearnerProxy(LearnerName):
    """A learner-defined name in the judge's namespace (see the module docstring)."""

    def __call__(self, *args, **kwargs):
        runner = launcher.current_runner()
        if runner is None:  # outside the judge (a maintainer's script): a plain one-rank launch
            report = launch(call_learner, 1, self.name, args, kwargs)[0]
        else:
            answer = runner.call(self.name, args, kwargs)
            if answer.get("status") != "ok":
                raise learner_exception(str(answer.get("type")), str(answer.get("message")))
            report = answer["value"]
        for original, state in zip(args, report["args"], strict=True):
            apply_state(original, state)
        for key, state in report["kwargs"].items():
            apply_state(kwargs[key], state)
        return report["result"]

    def __repr__(self):
        return f"<the learner's {self.name}>"

    def __getattr__(self, attribute):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        raise TypeError(f"a test cell used {self.name}.{attribute} outside a launched function: "
                        f"the grader runs learner code only in ranks (docs/authoring.md, rule 1)")


def apply_state(original, state):
    """Copy what a sandboxed call did to an argument back into the judge's own object."""
    if state is None:
        return
    if isinstance(original, torch.nn.Module) and isinstance(state, dict) and "parameters" in state:
        parameters, buffers = dict(original.named_parameters()), dict(original.named_buffers())
        with torch.no_grad():
            for name, value in state["parameters"].items():
                if name in parameters and parameters[name].shape == value.shape:
                    parameters[name].copy_(value)
            for name, value in state["buffers"].items():
                if name in buffers and buffers[name].shape == value.shape:
                    buffers[name].copy_(value)
        for name, grad in state["grads"].items():
            if name in parameters and parameters[name].shape == grad.shape:
                parameters[name].grad = grad.to(parameters[name].dtype)
        for name, value in state.get("attributes", {}).items():
            if hasattr(original, name) and type(getattr(original, name)) is type(value):
                setattr(original, name, value)
    elif isinstance(original, torch.Tensor) and isinstance(state, torch.Tensor):
        if original.shape == state.shape:
            with torch.no_grad():
                original.copy_(state)
    elif isinstance(original, (list, tuple)) and isinstance(state, (list, tuple)):
        for o, s in zip(original, state, strict=False):
            apply_state(o, s)
