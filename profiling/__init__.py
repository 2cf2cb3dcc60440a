"""Profiling and benchmarks: tokq profile, tokq bench, and the measurement scripts."""
