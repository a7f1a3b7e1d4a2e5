"""The grader side of 02_dataparallel."""
