"""The grader side of 01_first_principles."""
