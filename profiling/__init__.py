"""Profiling and benchmarks: `tokq profile` (profile/) and `tokq bench NAME` (bench/), the workload
they measure with (workload.py), and the generated blocks of RESULTS.md (results_md.py)."""
