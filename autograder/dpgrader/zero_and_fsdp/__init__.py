"""The grader side of 10_zero_and_fsdp."""
