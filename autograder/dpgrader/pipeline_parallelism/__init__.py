"""The grader side of 07_pipeline_parallelism."""
