"""Profiling and benchmarks: `tokq profile` (profile/), `tokq bench NAME` (bench/), the workload they
measure with (workload.py), what the benchmarks share (harness.py, results_md.py) and their results
by topic (results/*.md)."""
