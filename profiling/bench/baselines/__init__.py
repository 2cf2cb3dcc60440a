"""Baseline embedding servers `tokq bench service` measures tokq against, each a gRPC tokq.v1.Embedder:
``python -m tokq.profiling.bench.baselines --kind padded-batching --port 50061``."""
