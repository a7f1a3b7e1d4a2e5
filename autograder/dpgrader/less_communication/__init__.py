"""The grader side of 11_less_communication."""
