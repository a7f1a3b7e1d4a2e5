"""Planted bugs as small edits of a solution: `Bug(exercise, name, patch=[(old, new)], loses={...})`.

Why patches: a one-line bug hidden in a 40-line copy of the solution is hard to see and does
not follow changes to the solution. A patch names the line it breaks, and applying it checks
that `old` occurs exactly once in the exercise's solution code, so a bug breaks loudly (with
the exercise and the bug named) when the solution changes under it.

    BUGS = [
        Bug("my_slice", "contiguous_blocks",
            patch=[("return data[dist.get_rank()::dist.get_world_size()]",
                    "n = len(data) // dist.get_world_size()\\n    return data[:n]")],
            loses={"test_my_slice_basic": "has shape (2,), expected (3,)"}),
        Bug("my_slice", "does_not_parse", source="def my_slice(data)\\n    return data",
            loses={"test_my_slice_basic": "NameError"}),
        Bug(None, "edits_a_test_cell", cells={"test_my_slice_basic": "pass"},
            loses={"test_my_slice_basic": "NotImplementedError"}),
    ]

`source` replaces the exercise's cell whole (a real rewrite); `cells` replaces any other cells
by grade id. `loses`: test cell -> a fragment its failure message must contain (and 0 points);
`keeps`: test cells that must still get full marks.

Bugs in different exercises can share one graded notebook, `Variant(name, [Bug, ...])`: one
notebook through nbgrader instead of one per bug keeps the grading tests fast. Each bug keeps
its own `loses` and `keeps` (about its own exercise's test cells); the variant must lose and
keep all of them.

    BUGS = [Variant("sums_instead_of_averaging", [
        Bug("data_parallel_gradient", "gradient_sum", patch=[...], loses={...}),
        Bug("simulated_dp_step", "summed_gradients", patch=[...], loses={...}),
    ])]
"""

from dataclasses import dataclass, field

from dpgrader.solutions import solution_code


@dataclass
class Bug:
    exercise: str | None  # the exercise's key: the grade id of its solution cell
    name: str
    patch: list = field(default_factory=list)  # [(old, new)], each old exactly once in the solution
    source: str | None = None  # the exercise's whole cell, rewritten
    cells: dict = field(default_factory=dict)  # other cells replaced whole: grade_id -> source
    loses: dict = field(default_factory=dict)  # test grade_id -> fragment of its failure message
    keeps: list = field(default_factory=list)  # test grade_ids that must keep full marks

    def cell_sources(self, assignment):
        """{grade_id: source} of every cell this bug replaces in the released notebook."""
        cells = dict(self.cells)
        if self.exercise is not None and (self.patch or self.source is not None):
            code = self.source if self.source is not None else solution_code(assignment, self.exercise)
            for old, new in self.patch:
                count = code.count(old)
                if count != 1:
                    raise AssertionError(
                        f"planted bug {self.name!r} of {assignment}/{self.exercise}: the text to replace "
                        f"occurs {count} times in the solution (expected once), so the solution changed "
                        f"under the bug; update the patch. Text: {old!r}")
                code = code.replace(old, new)
            cells[self.exercise] = code
        return cells


@dataclass
class Variant:
    """Several planted bugs, in different exercises, graded together in one notebook."""

    name: str
    bugs: list

    exercise = None  # several: see `exercises`

    @property
    def exercises(self):
        return [bug.exercise for bug in self.bugs]

    @property
    def loses(self):
        merged = {}
        for bug in self.bugs:
            clash = set(merged) & set(bug.loses)
            assert not clash, f"variant {self.name!r}: two bugs claim the test cells {sorted(clash)}"
            merged.update(bug.loses)
        return merged

    @property
    def keeps(self):
        return [grade_id for bug in self.bugs for grade_id in bug.keeps]

    def cell_sources(self, assignment):
        cells = {}
        for bug in self.bugs:
            for grade_id, source in bug.cell_sources(assignment).items():
                assert grade_id not in cells, f"variant {self.name!r}: two bugs replace the cell {grade_id!r}"
                cells[grade_id] = source
        return cells
