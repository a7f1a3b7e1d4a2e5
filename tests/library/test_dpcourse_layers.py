"""dpcourse's floors: imports only run down, and no topic uses another topic's machinery.

A topic (course/dpcourse/topics/<subject>) holds one chapter's subject: its per-case functions, checks,
pictures and costs. What two chapters share lives below the topics (comm, checks, reference, toys, viz,
runtime), so that a guarantee or a rule is stated once. A chapter may build on an earlier chapter's
*subject* -- hybrid parallelism (09) on tensor parallelism's layers (08) and the pipeline's stages (07) --
as a dependency its package docstring states (SUBJECTS below); never on another topic's runs, checks,
benches, costs or measurements.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "course" / "dpcourse"
TOPICS = ROOT / "topics"
FLOORS = ("backend", "runtime", "grading", "comm", "checks", "reference", "toys", "viz")
# topic -> the modules of earlier chapters' topics it builds on (stated in its package docstring)
SUBJECTS = {"hybrid": {"tensor.layers", "tensor.models", "tensor.realapi", "pipeline.stages"},
            "gpt_in_3d": {"tensor.realapi"}}


def imports_of(path):
    """The dpcourse modules a file imports (absolute names), wherever in the file."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dpcourse"):
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("dpcourse"))


def modules(folder):
    return sorted(p for p in folder.rglob("*.py"))


def test_no_topic_imports_another_topics_machinery():
    found = []
    for path in modules(TOPICS):
        topic = path.relative_to(TOPICS).parts[0]
        for name in imports_of(path):
            parts = name.split(".")
            if parts[:2] != ["dpcourse", "topics"] or len(parts) < 3 or parts[2] == topic:
                continue
            if ".".join(parts[2:4]) not in SUBJECTS.get(topic, set()):
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not found, ("a topic imports another topic's machinery (move what they share below the "
                       "topics):\n" + "\n".join(found))


@pytest.mark.parametrize("topic", sorted(SUBJECTS))
def test_a_topic_states_the_subjects_it_builds_on(topic):
    doc = ast.get_docstring(ast.parse((TOPICS / topic / "__init__.py").read_text())) or ""
    missing = [f"topics.{name}" for name in sorted(SUBJECTS[topic]) if f"topics.{name}" not in doc]
    assert not missing, f"topics/{topic}/__init__.py's docstring does not say it builds on {missing}"


@pytest.mark.parametrize("floor", FLOORS)
def test_nothing_below_the_topics_imports_a_topic(floor):
    folder = ROOT / floor
    paths = modules(folder) if folder.is_dir() else [ROOT / f"{floor}.py"]
    found = [f"{p.relative_to(ROOT)} imports {name}" for p in paths for name in imports_of(p)
             if name.startswith("dpcourse.topics")]
    assert not found, "\n".join(found)


def test_the_rule_can_fail(tmp_path):
    """The scan sees an import of another topic's checks, even one inside a function."""
    planted = tmp_path / "x.py"
    planted.write_text("def f():\n    from dpcourse.topics.tensor.checks import expect_tensor\n")
    assert list(imports_of(planted)) == ["dpcourse.topics.tensor.checks"]
