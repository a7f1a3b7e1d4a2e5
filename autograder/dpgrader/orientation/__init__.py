"""The grader side of 00_orientation."""
