"""The grader side of 06_ddp_in_practice."""
