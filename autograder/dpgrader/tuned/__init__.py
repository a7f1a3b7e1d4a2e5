"""The instructor's tuned implementations: what the benchmarks race against torch's own.

Grader side, never released (they are solutions): `ring` (all-reduces for tests/bench/bench_allreduce.py),
`ddp` (bucketed, overlapped DDP for bench_ddp.py; its bucket rule is also the hidden checks' yardstick).
"""
