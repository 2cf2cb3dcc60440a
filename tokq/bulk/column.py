"""A blocking embedder of columns for dataframe engines (tokq.integrations): each call sends
one column's rows through a tokq fleet, as `tokq embed-file` sends a chunk, and returns their
vectors in row order. One instance per actor; its tokens in flight are bounded by its own
window (tokq.bulk.send.Window)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import grpc
import numpy as np

from tokq.bulk.send import EmbedOptions, FleetLimits, Sender, check_options, fetch_info
from tokq.bulk.sources import check_text
from tokq.client import check_priority

ON_ERROR = ("raise", "null")


class RowsFailed(ValueError):
    """Rows the fleet could not embed (``on_error="raise"``); ``errors``: row -> reason."""

    def __init__(self, errors: dict[int, str]) -> None:
        shown = "; ".join(f"row {i}: {why}" for i, why in sorted(errors.items())[:3])
        more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        super().__init__(f"{len(errors)} rows could not be embedded: {shown}{more}")
        self.errors = errors


class ColumnEmbedder:
    """``embed(texts)``: float32 [len(texts), dimensions], rows in order. A row that cannot be
    embedded (null, empty, too long without ``truncate``) raises ``RowsFailed`` with
    ``on_error="raise"``, or is NaN with ``on_error="null"`` (``embed_with_errors`` says why)."""

    def __init__(self, target: str = "localhost:50051", *, model: str = "", dimensions: int | None = None,
                 prompt_name: str | None = None, truncate: bool = False, normalize: bool = True,
                 timeout: float = 120.0, retry_for: float = 300.0, api_key: str | None = None,
                 credentials: grpc.ChannelCredentials | None = None, on_error: str = "raise",
                 priority: str | None = "batch") -> None:
        """``priority``: the queue class ("batch": the room live queries leave; None: the API
        key's default)."""
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {', '.join(ON_ERROR)}, got {on_error!r}")
        check_priority(priority)
        self.on_error = on_error
        self._options = EmbedOptions(dimensions=dimensions, prompt_name=prompt_name, truncate=truncate,
                                     normalize=normalize, priority=priority, timeout_s=timeout,
                                     retry_for_s=retry_for)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tokq-column", daemon=True)
        self._thread.start()
        try:
            self._sender = self._run(self._connect(target, model, api_key, credentials))
        except BaseException:
            self.close()
            raise

    async def _connect(self, target, model, api_key, credentials) -> Sender:
        from tokq.client import AsyncClient

        client = AsyncClient(target, credentials=credentials, model=model, api_key=api_key)
        try:
            info = await fetch_info(client, self._options)
            check_options(info, self._options, model)
        except BaseException:
            await client.close()
            raise
        return Sender(client, self._options, FleetLimits.from_info(info, self._options.dimensions))

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def dimensions(self) -> int:
        return self._sender.limits.dimensions

    @property
    def model(self) -> str:
        return self._sender.limits.model

    def embed_with_errors(self, texts: Sequence) -> tuple[np.ndarray, dict[int, str]]:
        """Vectors (NaN rows where a row failed) and each failed row's reason."""
        rows: list[str | None] = []
        errors: dict[int, str] = {}
        for i, value in enumerate(texts):
            text, why = check_text(value)
            if why:
                errors[i] = why
            rows.append(text)
        vectors, failed = self._run(self._sender.embed_rows(rows))
        errors.update(failed)
        if errors:
            vectors[sorted(errors)] = np.nan
        return vectors, errors

    def embed(self, texts: Sequence) -> np.ndarray:
        vectors, errors = self.embed_with_errors(texts)
        if errors and self.on_error == "raise":
            raise RowsFailed(errors)
        return vectors

    def close(self) -> None:
        if self._loop.is_closed():
            return
        sender = getattr(self, "_sender", None)
        if sender is not None and self._thread.is_alive():
            async def shut() -> None:
                await sender.close()
                await sender.client.close()
            self._run(shut())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> ColumnEmbedder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
