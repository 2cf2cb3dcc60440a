"""Daft on a tokq fleet: a Daft class that embeds a text column, batch by batch, with the same
client and bounded tokens in flight as `tokq embed-file` (one fleet connection per instance).

    import daft
    from tokq.integrations.daft import embedder

    embed = embedder("localhost:50051")
    df = daft.read_parquet("docs.parquet")
    df = df.with_column("embedding", embed(df["text"]))
    df.write_parquet("embedded/")
"""

from __future__ import annotations

import daft
import numpy as np
import pyarrow as pa

from tokq.bulk.column import ON_ERROR, ColumnEmbedder
from tokq.client import check_priority
from tokq.integrations import credentials_from

BATCH_ROWS = 1024


def _served_dimensions(target: str, model: str, api_key: str | None, credentials) -> int:
    from tokq.client import Client

    with Client(target, credentials=credentials, model=model, api_key=api_key, connections=1) as client:
        return client.info(timeout=30).dimensions


def embedder(target: str = "localhost:50051", *, model: str = "", dimensions: int | None = None,
             prompt_name: str | None = None, truncate: bool = False, normalize: bool = True,
             api_key: str | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
             tls_key: str | None = None, timeout: float = 120.0, retry_for: float = 300.0,
             on_error: str = "raise", batch_size: int = BATCH_ROWS, max_concurrency: int | None = None,
             priority: str | None = "batch"):
    """A Daft class instance; call it on a string column for an Embedding[Float32; dims] column.

    ``dimensions`` (else the served model's, asked of the gateway here); ``on_error``: "raise"
    fails the query on a row the fleet refuses, "null" leaves that row null. ``max_concurrency``:
    instances, each with its own connection and window of tokens in flight. ``priority``: the
    queue class ("batch": the room live queries leave; "interactive"; None: the API key's
    default). TLS: PEM file paths, read where each instance runs."""
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {', '.join(ON_ERROR)}, got {on_error!r}")
    check_priority(priority)
    dims = dimensions or _served_dimensions(target, model, api_key, credentials_from(tls_ca, tls_cert, tls_key))
    settings = dict(model=model, dimensions=dimensions, prompt_name=prompt_name, truncate=truncate,
                    normalize=normalize, timeout=timeout, retry_for=retry_for, api_key=api_key,
                    on_error=on_error, priority=priority)
    tls = (tls_ca, tls_cert, tls_key)

    @daft.cls(max_concurrency=max_concurrency, name_override="tokq_embed")
    class TokqEmbed:
        def __init__(self, target: str, settings: dict, tls: tuple) -> None:
            self.embedder = ColumnEmbedder(target, credentials=credentials_from(*tls), **settings)

        @daft.method.batch(return_dtype=daft.DataType.embedding(daft.DataType.float32(), dims),
                           batch_size=batch_size)
        def __call__(self, texts: daft.Series) -> pa.Array:
            vectors, errors = self.embedder.embed_with_errors(texts.to_pylist())
            if errors and self.embedder.on_error == "raise":
                from tokq.bulk.column import RowsFailed

                raise RowsFailed(errors)
            mask = np.zeros(len(vectors), dtype=bool)
            mask[list(errors)] = True
            values = np.where(mask[:, None], np.float32(0), vectors)
            return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), dims, mask=pa.array(mask))

    return TokqEmbed(target, settings, tls)
