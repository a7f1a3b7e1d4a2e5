"""The grader side of 08_tensor_parallelism."""
