"""The grader side of 13_gpt_in_3d."""
