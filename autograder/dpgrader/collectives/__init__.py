"""The grader side of 03_collectives."""
