"""The grader side of 12_sequence_and_experts."""
