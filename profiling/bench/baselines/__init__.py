"""Baseline embedding servers that `tokq bench service` measures tokq against, each a real gRPC server
speaking tokq.v1.Embedder: sentence-transformers one request at a time, ONNX Runtime one
request at a time (on an ONNX export of the same model), and Triton-style dynamic batching
(wait up to X ms or N requests, pad to the longest).

Run one with ``python -m tokq.profiling.bench.baselines --kind padded-batching --port 50061``."""
