"""Where a bulk job's results go. While it runs, each finished chunk of rows is committed as its
own file in OUTPUT.tokq-parts/ (written whole, then renamed into place), beside the job's
settings; a rerun reads them back and sends only the rest. At the end the parts become OUTPUT
(.parquet or .npy) and OUTPUT.errors.jsonl, each written whole and renamed into place, and the
parts folder goes.

A Parquet output holds the rows embedded (its id or row column says which), a .npy output
every row (NaN where a row failed); OUTPUT.errors.jsonl lists the failed rows and why.

A finished Parquet output carries the job's settings in its schema metadata, a finished .npy
in OUTPUT.tokq.json: a rerun of the same job finds it done, another job needs --overwrite.
"""

from __future__ import annotations

import fcntl
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa

PARTS_SUFFIX = ".tokq-parts"
ERRORS_SUFFIX = ".errors.jsonl"
NPY_RECORD_SUFFIX = ".tokq.json"
METADATA_KEY = b"tokq.embed_file"
JOB_FILE = "job.json"
LOCK_FILE = "lock"
PART_RE = re.compile(r"^rows-(\d{12})-(\d{12})\.arrow$")
OUTPUT_FORMATS = {".parquet": "parquet", ".npy": "npy"}
EMBEDDING_COLUMN = "embedding"
ROW_COLUMN = "row"


class StoreError(Exception):
    """The output cannot be written as asked (another job's, unwritable, in use)."""


def output_format(path: str | os.PathLike) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in OUTPUT_FORMATS:
        raise StoreError(f"{os.fspath(path)!r}: the output must end in .parquet or .npy")
    return OUTPUT_FORMATS[suffix]


def errors_path(output: str | os.PathLike) -> Path:
    return Path(os.fspath(output) + ERRORS_SUFFIX)


def parts_path(output: str | os.PathLike) -> Path:
    return Path(os.fspath(output) + PARTS_SUFFIX)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _differences(want: dict, have: dict) -> str:
    out = []
    for key in sorted(set(want) | set(have)):
        if want.get(key) != have.get(key):
            out.append(f"{key}: {have.get(key)!r} there, {want.get(key)!r} now")
    return "; ".join(out)


def _remove_tree(path: Path) -> None:
    """Gone at once (one rename), then deleted: a crash meanwhile leaves no half-deleted parts."""
    if not path.exists():
        return
    doomed = path.with_name(f"{path.name}.old-{os.getpid()}")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


@dataclass(frozen=True)
class Finished:
    rows: int
    failed: int


def read_record(output: Path) -> dict | None:
    """The record a finished output carries (its job and counts), None if it has none."""
    try:
        if output_format(output) == "parquet":
            import pyarrow.parquet as pq

            meta = pq.read_schema(output).metadata or {}
            raw = meta.get(METADATA_KEY)
        else:
            record = Path(os.fspath(output) + NPY_RECORD_SUFFIX)
            raw = record.read_bytes() if record.exists() else None
        return orjson.loads(raw) if raw else None
    except (OSError, pa.ArrowException, orjson.JSONDecodeError):
        return None


class PartStore:
    """The parts of one job beside ``output``; ``open()`` locks them (one writer at a time)."""

    def __init__(self, output: str | os.PathLike, job: dict, *, dimensions: int,
                 id_type: pa.DataType | None, rows_per_part: int) -> None:
        self.output = Path(os.path.abspath(os.fspath(output)))
        self.format = output_format(self.output)
        self.parts = parts_path(self.output)
        self.errors_file = errors_path(self.output)
        self.job = job
        self.dimensions = dimensions
        self.id_type = id_type
        self.rows_per_part = rows_per_part
        self.finished: Finished | None = None  # set by open() when the output is already done
        self.done: dict[int, tuple[int, int]] = {}  # part index -> (start, end) committed
        self._lock = None
        self.schema = pa.schema(
            ([pa.field("id", id_type)] if id_type is not None else [])
            + [pa.field(EMBEDDING_COLUMN, pa.list_(pa.float32(), dimensions)),
               pa.field("error", pa.string())])

    # -- opening ------------------------------------------------------------------------------

    def open(self, overwrite: bool) -> None:
        parent = self.output.parent
        if not parent.is_dir():
            raise StoreError(f"{str(parent)!r} is not a folder: the output's folder must exist")
        for old in parent.glob(f"{self.parts.name}.old-*"):  # a removal a crash interrupted
            shutil.rmtree(old, ignore_errors=True)
        created = not self.parts.exists()
        try:
            self.parts.mkdir(exist_ok=True)
            self._lock = open(self.parts / LOCK_FILE, "a")
        except OSError as exc:
            raise StoreError(f"cannot write beside {str(self.output)!r}: {exc.strerror}") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            self._lock = None
            raise StoreError(f"another tokq embed-file is writing {str(self.output)!r} "
                             f"({self.parts.name} is locked)") from None
        try:
            self._open_locked(overwrite, created)
        except BaseException:
            self.close()
            raise

    def _open_locked(self, overwrite: bool, created: bool) -> None:
        job_file = self.parts / JOB_FILE
        if job_file.exists():
            try:
                have = orjson.loads(job_file.read_bytes())
            except (OSError, orjson.JSONDecodeError):
                have = {}
            if have != self.job:
                if not overwrite:
                    raise StoreError(
                        f"{str(self.parts)!r} holds the parts of another job ({_differences(self.job, have)}): "
                        "rerun with the same input and options to continue it, or add --overwrite to "
                        "start again")
                self._clear_parts()
        elif self.output.exists():
            record = read_record(self.output)
            if record is not None and record.get("job") == self.job and not overwrite:
                self.finished = Finished(record["rows"], record["failed"])
                self._release_and_drop(created)
                return
            if not overwrite:
                why = (f"another job's output ({_differences(self.job, record.get('job') or {})})"
                       if record else "not an output of tokq embed-file")
                self._release_and_drop(created)
                raise StoreError(f"{str(self.output)!r} exists and is {why}: add --overwrite to replace it")
        if overwrite:
            for path in (self.output, self.errors_file, Path(os.fspath(self.output) + NPY_RECORD_SUFFIX)):
                path.unlink(missing_ok=True)
        if not job_file.exists():
            _write_atomic(job_file, orjson.dumps(self.job, option=orjson.OPT_SORT_KEYS))
        for entry in self.parts.iterdir():
            if entry.name.endswith(".tmp"):  # a part a crash cut short
                entry.unlink(missing_ok=True)
            elif m := PART_RE.match(entry.name):
                start, end = int(m[1]), int(m[2])
                self.done[start // self.rows_per_part] = (start, end)

    def _clear_parts(self) -> None:
        for entry in self.parts.iterdir():
            if entry.name != LOCK_FILE:
                entry.unlink()

    def _release_and_drop(self, created: bool) -> None:
        """Leave no parts folder this run made only to look."""
        if created:
            shutil.rmtree(self.parts, ignore_errors=True)
        self.close()

    def close(self) -> None:
        if self._lock is not None:
            self._lock.close()  # releases the lock
            self._lock = None

    @property
    def committed_rows(self) -> int:
        return sum(end - start for start, end in self.done.values())

    # -- committing ---------------------------------------------------------------------------

    def commit(self, index: int, start: int, ids: list | None, vectors: np.ndarray,
               errors: dict[int, str]) -> None:
        """Rows [start, start + len(vectors)) made durable: written whole, then renamed."""
        n = len(vectors)
        mask = np.zeros(n, dtype=bool)
        for i in errors:
            mask[i] = True
        values = np.where(mask[:, None], np.float32(0), vectors).astype(np.float32, copy=False)
        embedding = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), self.dimensions,
                                                      mask=pa.array(mask))
        columns = ([pa.array(ids, type=self.id_type)] if self.id_type is not None else []) + [
            embedding, pa.array([errors.get(i) for i in range(n)], type=pa.string())]
        table = pa.Table.from_arrays(columns, schema=self.schema)
        name = f"rows-{start:012d}-{start + n:012d}.arrow"
        tmp = self.parts / f".{name}.tmp"
        with open(tmp, "wb") as f:
            with pa.ipc.new_file(f, self.schema) as writer:
                writer.write_table(table)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.parts / name)
        _fsync_dir(self.parts)
        self.done[index] = (start, start + n)

    # -- finishing ----------------------------------------------------------------------------

    def _part_tables(self, rows: int):
        n = self.rows_per_part
        for k in range(math.ceil(rows / n)):
            start, end = k * n, min(rows, (k + 1) * n)
            if self.done.get(k) != (start, end):
                raise StoreError(f"rows {start:,}-{end:,} are not committed in {str(self.parts)!r}; "
                                 "rerun the same command to embed them")
            path = self.parts / f"rows-{start:012d}-{end:012d}.arrow"
            try:
                with pa.memory_map(str(path)) as source:
                    table = pa.ipc.open_file(source).read_all()
            except (OSError, pa.ArrowException) as exc:
                raise StoreError(f"{str(path)!r} cannot be read ({exc}): delete it and rerun the same "
                                 "command to embed its rows again") from None
            yield start, table

    def finish(self, rows: int) -> Finished:
        """The output and errors file from the parts, each renamed into place when whole; then
        the parts folder goes."""
        failed = sum(table.num_rows - table.column("error").null_count
                     for _, table in self._part_tables(rows))
        record = {"job": self.job, "rows": rows, "failed": failed}
        tmp_out = self.output.with_name(f".{self.output.name}.{os.getpid()}.tmp")
        tmp_err = self.errors_file.with_name(f".{self.errors_file.name}.{os.getpid()}.tmp")
        schema = self._output_schema(record)
        with open(tmp_err, "wb") as errors_out, open(tmp_out, "wb") as out:
            writer = None
            if self.format == "npy":
                np.lib.format.write_array_header_1_0(
                    out, {"descr": "<f4", "fortran_order": False, "shape": (rows, self.dimensions)})
            else:
                import pyarrow.parquet as pq

                writer = pq.ParquetWriter(out, schema)
            for start, table in self._part_tables(rows):
                ids = table.column("id").to_pylist() if self.id_type is not None else None
                for i, reason in enumerate(table.column("error").to_pylist()):
                    if reason is not None:
                        errors_out.write(orjson.dumps(
                            {"row": start + i, "id": ids[i] if ids is not None else None, "reason": reason},
                            default=str) + b"\n")
                embedding = table.column(EMBEDDING_COLUMN).combine_chunks()
                if writer is None:
                    values = embedding.values.to_numpy(zero_copy_only=False).reshape(-1, self.dimensions).copy()
                    values[embedding.is_null().to_numpy(zero_copy_only=False)] = np.nan
                    out.write(values.astype("<f4", copy=False).tobytes())
                else:
                    first = (table.column("id") if self.id_type is not None
                             else pa.array(np.arange(start, start + table.num_rows, dtype=np.int64)))
                    part = pa.Table.from_arrays([first, embedding], schema=schema)
                    # failed rows are left out: the id or row column says which rows are here
                    writer.write_table(part.filter(table.column("error").is_null()))
            if writer is not None:
                writer.close()
            out.flush()
            os.fsync(out.fileno())
            errors_out.flush()
            os.fsync(errors_out.fileno())
        if failed:
            os.replace(tmp_err, self.errors_file)
        else:
            tmp_err.unlink()
            self.errors_file.unlink(missing_ok=True)
        if self.format == "npy":
            _write_atomic(Path(os.fspath(self.output) + NPY_RECORD_SUFFIX), orjson.dumps(record))
        os.replace(tmp_out, self.output)
        _fsync_dir(self.output.parent)
        self.close()
        _remove_tree(self.parts)
        return Finished(rows, failed)

    def _output_schema(self, record: dict) -> pa.Schema:
        first = (pa.field("id", self.id_type) if self.id_type is not None
                 else pa.field(ROW_COLUMN, pa.int64(), nullable=False))
        return pa.schema([first, pa.field(EMBEDDING_COLUMN, pa.list_(pa.float32(), self.dimensions),
                                          nullable=False)],
                         metadata={METADATA_KEY: orjson.dumps(record, option=orjson.OPT_SORT_KEYS)})
