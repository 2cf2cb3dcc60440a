"""One `tokq embed-file` job: read the input in chunks, send each chunk's rows, commit each
chunk when all its rows are answered, and write the output once every chunk is committed."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tokq.bulk.progress import Progress
from tokq.bulk.send import BulkError, EmbedOptions, FleetLimits, Sender, check_options, fetch_info, first_error
from tokq.bulk.sources import open_source
from tokq.bulk.store import Finished, PartStore, output_format
from tokq.client import AsyncClient, TokqError

JOB_VERSION = 1
ROWS_PER_PART = 2048
RETRY_NOTE_EVERY_S = 10.0


@dataclass(frozen=True)
class JobSpec:
    input: str
    output: str
    text_field: str = "text"
    id_field: str | None = None
    model: str = ""
    options: EmbedOptions = field(default_factory=EmbedOptions)
    rows_per_part: int = ROWS_PER_PART
    overwrite: bool = False


@dataclass
class JobResult:
    finished: Finished
    already_done: bool  # the output was complete before this run
    rows_this_run: int
    resumed_rows: int  # committed by earlier runs
    seconds: float


def job_record(spec: JobSpec, source, limits: FleetLimits) -> dict:
    """What makes two runs the same job: a rerun continues only with all of these equal."""
    stat = os.stat(spec.input)
    o = spec.options
    return {"tokq_embed_file": JOB_VERSION,
            "input": os.path.abspath(spec.input), "input_format": source.format,
            "input_bytes": stat.st_size, "input_mtime_ns": stat.st_mtime_ns,
            "text_field": spec.text_field if source.format != "txt" else None, "id_field": spec.id_field,
            "model": limits.model, "dimensions": limits.dimensions, "prompt_name": o.prompt_name,
            "truncate": o.truncate, "normalize": o.normalize,
            "output_format": output_format(spec.output), "rows_per_part": spec.rows_per_part}


class _Retries:
    """Says now and then that requests are being retried (not once per request)."""

    def __init__(self, progress: Progress, target: str) -> None:
        self.progress = progress
        self.target = target
        self.last = -RETRY_NOTE_EVERY_S

    def __call__(self, exc: TokqError) -> None:
        now = time.monotonic()
        if now - self.last >= RETRY_NOTE_EVERY_S:
            self.last = now
            self.progress.note(f"embed-file: {self.target}: {exc.code.name}: {exc.message}; retrying")


async def run_job(spec: JobSpec, connect: Callable[[], AsyncClient], *, target: str = "",
                  progress_stream=None, terminal: bool | None = None) -> JobResult:
    started = time.monotonic()
    output_format(spec.output)  # refused before reading or connecting
    source = open_source(spec.input, spec.text_field, spec.id_field)
    client = connect()
    try:
        progress = Progress(lambda: None, stream=progress_stream, terminal=False)
        info = await fetch_info(client, spec.options, on_retry=_Retries(progress, target))
        check_options(info, spec.options, spec.model)
        limits = FleetLimits.from_info(info, spec.options.dimensions)
        store = PartStore(spec.output, job_record(spec, source, limits), dimensions=limits.dimensions,
                          id_type=source.id_type, rows_per_part=spec.rows_per_part)
        await asyncio.to_thread(store.open, spec.overwrite)
        if store.finished is not None:
            return JobResult(store.finished, True, 0, store.finished.rows, time.monotonic() - started)
        try:
            resumed = store.committed_rows

            def fraction() -> float | None:
                total = source.estimated_rows()
                if total is None:
                    return None
                return min(1.0, progress.rows / total) if total else 1.0

            progress = Progress(fraction, committed_rows=resumed, stream=progress_stream, terminal=terminal)
            if resumed:
                progress.note(f"embed-file: resuming: {resumed:,} rows already committed in {store.parts}")
            sender = Sender(client, spec.options, limits, on_retry=_Retries(progress, target))
            with progress:
                try:
                    await _embed_chunks(source, store, sender, progress, spec.rows_per_part)
                finally:
                    await sender.close()
                rows = source.total_rows if source.total_rows is not None else source.rows
                finished = await asyncio.to_thread(store.finish, rows)
            return JobResult(finished, False, progress.rows - resumed, resumed, time.monotonic() - started)
        finally:
            store.close()
    finally:
        await client.close()


async def _embed_chunks(source, store: PartStore, sender: Sender, progress: Progress,
                        rows_per_part: int) -> None:
    chunks = source.chunks(rows_per_part, set(store.done))
    ticker = asyncio.get_running_loop().create_task(_tick(sender, progress))
    try:
        async with first_error():
            async with asyncio.TaskGroup() as tasks:
                while True:
                    # the reader runs ahead of the requests by one chunk at most
                    chunk = await asyncio.to_thread(next, chunks, None)
                    if chunk is None:
                        break
                    dispatched = asyncio.Event()
                    tasks.create_task(_embed_chunk(chunk, store, sender, progress, dispatched))
                    await dispatched.wait()
    finally:
        ticker.cancel()
    progress.update(0, sender.tokens)


async def _tick(sender: Sender, progress: Progress) -> None:
    while True:
        await asyncio.sleep(1.0)
        progress.update(0, sender.tokens)


async def _embed_chunk(chunk, store: PartStore, sender: Sender, progress: Progress,
                       dispatched: asyncio.Event) -> None:
    vectors, errors = await sender.embed_rows(chunk.texts, on_dispatched=dispatched.set)
    dispatched.set()
    errors.update(chunk.errors)
    await asyncio.to_thread(store.commit, chunk.index, chunk.start, chunk.ids, vectors, errors)
    progress.update(len(chunk.texts), sender.tokens)


def describe_error(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, BulkError) else f"{type(exc).__name__}: {exc}"
