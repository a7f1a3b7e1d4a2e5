"""The grader side of 09_hybrid_parallelism."""
