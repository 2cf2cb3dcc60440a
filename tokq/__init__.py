"""tokq: token-count batching for embedding inference over Redis + Lua."""

__version__ = "0.1.0"

__all__ = ["Client", "AsyncClient", "TokqError", "__version__"]


def __getattr__(name: str):
    # The client pulls in grpc; keep `import tokq` cheap for workers and tools.
    if name in ("Client", "AsyncClient", "TokqError"):
        from tokq import client

        return getattr(client, name)
    raise AttributeError(name)
