"""Profiling and benchmarks: `tokq profile` (profile/) and `tokq bench NAME` (bench/), the workload
they measure with (workload.py), and the generated sections of profiling/results/*.md (results_md.py)."""
