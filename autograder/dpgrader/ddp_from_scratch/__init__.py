"""The grader side of 05_ddp_from_scratch."""
