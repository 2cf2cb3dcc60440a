"""Ray Data on a tokq fleet: a callable class for ``Dataset.map_batches`` that embeds a text
column with the same client and bounded tokens in flight as `tokq embed-file` (one fleet
connection per actor).

    import ray
    from tokq.integrations.ray import TokqEmbed

    ds = ray.data.read_parquet("docs.parquet")
    ds = ds.map_batches(TokqEmbed, fn_constructor_kwargs={"target": "localhost:50051"},
                        concurrency=2, batch_size=1024)
    ds.write_parquet("embedded/")
"""

from __future__ import annotations

from tokq.bulk.column import ColumnEmbedder
from tokq.integrations import credentials_from


class TokqEmbed:
    """``column`` in, ``output_column`` out: float32 [rows, dims] per batch (numpy or pandas
    batches). ``on_error``: "raise" fails the batch on a row the fleet refuses, "null" leaves
    that row NaN. ``priority``: the queue class ("batch": the room live queries leave;
    "interactive"; None: the API key's default). TLS: PEM file paths, read where the actor runs."""

    def __init__(self, target: str = "localhost:50051", *, column: str = "text",
                 output_column: str = "embedding", model: str = "", dimensions: int | None = None,
                 prompt_name: str | None = None, truncate: bool = False, normalize: bool = True,
                 api_key: str | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, timeout: float = 120.0, retry_for: float = 300.0,
                 on_error: str = "raise", priority: str | None = "batch") -> None:
        self.column = column
        self.output_column = output_column
        self.embedder = ColumnEmbedder(target, model=model, dimensions=dimensions, prompt_name=prompt_name,
                                       truncate=truncate, normalize=normalize, timeout=timeout,
                                       retry_for=retry_for, api_key=api_key, on_error=on_error,
                                       priority=priority,
                                       credentials=credentials_from(tls_ca, tls_cert, tls_key))

    def __call__(self, batch):
        texts = batch[self.column]
        vectors = self.embedder.embed(texts.tolist() if hasattr(texts, "tolist") else list(texts))
        if isinstance(batch, dict):  # numpy batches: a 2-D array becomes a tensor column
            return {**batch, self.output_column: vectors}
        batch = batch.copy()  # pandas
        batch[self.output_column] = list(vectors)
        return batch

    def __del__(self) -> None:
        embedder = getattr(self, "embedder", None)
        if embedder is not None:
            embedder.close()
