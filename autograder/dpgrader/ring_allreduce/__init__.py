"""The grader side of 04_ring_allreduce."""
