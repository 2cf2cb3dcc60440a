"""tokq.v1: the versioned gRPC API."""
