"""The instructor's tuned implementations: what the benchmarks race against torch's own.

Grader side, never released (they are solutions): `ring` (all-reduces for tests/bench/bench_allreduce.py),
`ddp` (bucketed, overlapped DDP for bench_ddp.py; its bucket rule is also the hidden checks' yardstick),
`pipeline` (a 1F1B executor for bench_pipeline.py, raced against torch's Schedule1F1B).
"""
