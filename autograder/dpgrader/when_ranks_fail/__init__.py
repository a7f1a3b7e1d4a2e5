"""The grader side of 14_when_ranks_fail."""
