"""The tokq gRPC gateway."""
