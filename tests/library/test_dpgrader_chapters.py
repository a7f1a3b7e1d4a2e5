"""dpgrader.chapters: one name per chapter, derived from its assignment's folder in one place."""

import pytest

from dpgrader.chapters import CHAPTERS, assignments, chapter_of


def test_a_chapter_is_its_assignment_without_the_number():
    assert chapter_of("10_zero_and_fsdp") == "zero_and_fsdp"
    assert chapter_of("02_dataparallel") == "dataparallel"
    assert chapter_of("13_gpt_in_3d") == "gpt_in_3d" and chapter_of("14_when_ranks_fail") == "when_ranks_fail"
    for bad in ("zero_and_fsdp", "10-zero", "1_x", "10_"):
        with pytest.raises(ValueError, match="not an assignment's name"):
            chapter_of(bad)


def test_new_chapters_are_found_by_their_folders(tmp_path):
    for name in ("00_orientation", "13_gpt_in_3d", "14_when_ranks_fail", "notes", "15_empty"):
        (tmp_path / "solutions" / name).mkdir(parents=True)
        if name != "15_empty":
            (tmp_path / "solutions" / name / f"{name}.ipynb").write_text("{}")
    assert assignments(tmp_path) == ["00_orientation", "13_gpt_in_3d", "14_when_ranks_fail"]


def test_every_chapter_has_its_grader_package():
    """The repository's own chapters, each with autograder/dpgrader/<chapter>/."""
    from dpgrader.chapters import REPO

    assert CHAPTERS and all((REPO / "autograder" / "dpgrader" / c).is_dir() for c in CHAPTERS)
