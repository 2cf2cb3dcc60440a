"""A bulk job's input, read in order with bounded memory: .txt (a row per line), .jsonl, .csv and
.parquet, cut into chunks of a fixed number of rows.

A row that cannot be embedded (not UTF-8, empty, a JSONL line that does not parse, a missing
field) carries its reason instead of a text; a problem with the whole file is a ``SourceError``.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import pyarrow as pa

FORMATS = {".txt": "txt", ".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet"}
# A longer line is read in pieces and fails as a row: memory stays bounded whatever the file holds.
MAX_LINE_BYTES = 16 << 20
PARQUET_BATCH_ROWS = 1024
CSV_BLOCK_BYTES = 256 << 10  # pyarrow reads ~20 blocks ahead; a longer row still reads


class SourceError(Exception):
    """The input cannot be read as asked (missing field, malformed CSV, unreadable file)."""


@dataclass
class Chunk:
    """Rows [start, start + len(texts)) of the input; ``texts[i]`` is None where ``errors[i]``
    says why that row is not sent."""

    index: int
    start: int
    texts: list[str | None]
    ids: list | None
    errors: dict[int, str] = field(default_factory=dict)

    @property
    def end(self) -> int:
        return self.start + len(self.texts)


@dataclass(frozen=True)
class Done:
    """The chunks a resumed job has committed: chunk k holds rows [k*size, (k+1)*size)."""

    size: int
    chunks: set[int]

    def row(self, row: int) -> bool:
        return row // self.size in self.chunks

    def all(self, start: int, end: int) -> bool:
        """Every row of [start, end) is done."""
        return all(k in self.chunks for k in range(start // self.size, (end - 1) // self.size + 1))


@dataclass
class _Block:
    start: int
    texts: list[str | None]
    ids: list | None
    errors: dict[int, str]


def input_format(path: str | os.PathLike) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise SourceError(f"{os.fspath(path)!r}: unknown input format {suffix or '(no extension)'!r}; "
                          f"name a file ending in {', '.join(FORMATS)}")
    return FORMATS[suffix]


def _decode(raw: bytes) -> tuple[str | None, str | None]:
    """(text, None) or (None, reason) for UTF-8 bytes."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"not valid UTF-8 (byte {exc.start:,} of the text)"
    if not text:
        return None, "empty text"
    return text, None


def check_text(value) -> tuple[str | None, str | None]:
    if value is None:
        return None, "the text is null"
    if not isinstance(value, str):
        return None, f"the text is a {type(value).__name__}, not a string"
    if not value:
        return None, "empty text"
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return None, f"not valid UTF-8 (a lone surrogate at character {exc.start:,})"
    return value, None


class Source:
    """One input file. ``rows``: rows read so far, all of them once ``complete`` (``total_rows``
    is known at once where the format says it); ``fraction()``: how far reading has come."""

    format: str
    id_type: pa.DataType | None = None
    total_rows: int | None = None

    def __init__(self, path: str | os.PathLike, text_field: str, id_field: str | None) -> None:
        self.path = os.fspath(path)
        self.text_field = text_field
        self.id_field = id_field
        self.rows = 0
        self.complete = False
        try:
            self.size = os.path.getsize(self.path)
        except OSError as exc:
            raise SourceError(f"{self.path!r}: {exc.strerror}") from None

    def fraction(self) -> float | None:
        return None

    def estimated_rows(self) -> float | None:
        """All rows: known, or extrapolated from how far reading has come."""
        if self.total_rows is not None:
            return self.total_rows
        if self.complete:
            return self.rows
        fraction = self.fraction()
        return self.rows / fraction if fraction else None

    def blocks(self, done: Done) -> Iterator[_Block]:
        """Rows in order; rows of chunks in ``done`` may be left out (a resumed job's)."""
        raise NotImplementedError

    def chunks(self, rows_per_chunk: int, done: set[int]) -> Iterator[Chunk]:
        """The chunks not in ``done`` (chunk k: rows [k*n, (k+1)*n)), in order."""
        n = rows_per_chunk
        current: Chunk | None = None
        for block in self.blocks(Done(n, done)):
            pos = 0
            size = len(block.texts)
            while pos < size:
                row = block.start + pos
                k = row // n
                take = min(size - pos, (k + 1) * n - row)
                if k not in done:
                    if current is not None and current.index != k:
                        yield current
                        current = None
                    if current is None:
                        current = Chunk(k, row, [], [] if block.ids is not None else None)
                    assert current.end == row, "rows of a chunk arrive in order"
                    base = len(current.texts)
                    current.texts.extend(block.texts[pos:pos + take])
                    if block.ids is not None:
                        current.ids.extend(block.ids[pos:pos + take])
                    for i, reason in block.errors.items():
                        if pos <= i < pos + take:
                            current.errors[base + i - pos] = reason
                pos += take
        self.complete = True  # every row read: ``rows`` is the count
        if current is not None:
            yield current


class _LineSource(Source):
    """A row per line: the file is read line by line, never whole."""

    def _lines(self) -> Iterator[tuple[int, bytes, bool]]:
        """(line number from 1, line without its end, whether it was cut at MAX_LINE_BYTES)."""
        try:
            f = open(self.path, "rb")
        except OSError as exc:
            raise SourceError(f"{self.path!r}: {exc.strerror}") from None
        self._file = f
        self._read_all = False
        with f:
            number = 0
            while True:
                line = f.readline(MAX_LINE_BYTES + 1)
                if not line:
                    self._read_all = True
                    return
                number += 1
                cut = False
                if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
                    cut = True
                    while True:  # the rest of the line, dropped piece by piece
                        rest = f.readline(MAX_LINE_BYTES)
                        if not rest or rest.endswith(b"\n"):
                            break
                    line = b""
                if line.endswith(b"\n"):
                    line = line[:-1]
                    if line.endswith(b"\r"):
                        line = line[:-1]
                yield number, line, cut

    def fraction(self) -> float | None:
        if getattr(self, "_read_all", False):
            return 1.0
        f = getattr(self, "_file", None)
        if f is None or f.closed or not self.size:
            return None
        try:
            return min(1.0, f.tell() / self.size)
        except (OSError, ValueError):
            return None


class TextSource(_LineSource):
    format = "txt"

    def __init__(self, path, text_field: str, id_field: str | None) -> None:
        if id_field:
            raise SourceError("a .txt input has no fields: --id-field needs .jsonl, .csv or .parquet")
        super().__init__(path, text_field, None)

    def blocks(self, done):
        texts: list[str | None] = []
        errors: dict[int, str] = {}
        start = 0
        for number, line, cut in self._lines():
            row = number - 1
            if done.row(row):
                if texts:
                    yield _Block(start, texts, None, errors)
                    texts, errors = [], {}
                self.rows = start = row + 1
                continue
            if cut:
                text, reason = None, f"line {number:,} is over {MAX_LINE_BYTES >> 20} MiB"
            else:
                text, reason = _decode(line)
                if reason == "empty text":
                    reason = f"line {number:,} is empty"
                elif reason:
                    reason = f"line {number:,}: {reason}"
            if reason:
                errors[len(texts)] = reason
            texts.append(text)
            if len(texts) >= PARQUET_BATCH_ROWS:
                yield _Block(start, texts, None, errors)
                start += len(texts)
                texts, errors = [], {}
            self.rows = row + 1
        if texts:
            yield _Block(start, texts, None, errors)


def _json_type(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
            bool: "a boolean", type(None): "null"}.get(type(value), type(value).__name__)


class JsonlSource(_LineSource):
    """A JSON object per line; blank lines are skipped (they are not rows)."""

    format = "jsonl"

    def __init__(self, path, text_field: str, id_field: str | None) -> None:
        super().__init__(path, text_field, id_field)
        self._check_first_row()

    def _check_first_row(self) -> None:
        """The first row must hold the fields asked for: a wrong --text-field stops here, not
        after a whole file of failed rows. Its id's type is the id column's."""
        lines = self._lines()
        for number, line, cut in lines:
            if not line.strip():
                continue
            where = f"{self.path!r} line {number:,}"
            try:
                obj = orjson.loads(line) if not cut else None
            except orjson.JSONDecodeError as exc:
                raise SourceError(f"{where} is not JSON ({exc}): a .jsonl input holds a JSON object "
                                  "per line") from None
            if not isinstance(obj, dict):
                raise SourceError(f"{where} is {_json_type(obj)}, not a JSON object: a .jsonl input "
                                  "holds a JSON object per line")
            fields = ", ".join(repr(k) for k in list(obj)[:20]) or "none"
            for flag, name in (("--text-field", self.text_field), ("--id-field", self.id_field)):
                if name and name not in obj:
                    raise SourceError(f"{where} has no field {name!r} (its fields: {fields}); name "
                                      f"the field with {flag}")
            if self.id_field:
                value = obj[self.id_field]
                if isinstance(value, bool) or not isinstance(value, (int, str, float)):
                    raise SourceError(f"{where}: the id field {self.id_field!r} is {_json_type(value)}; "
                                      "ids must be strings or numbers")
                self.id_type = (pa.int64() if isinstance(value, int) else
                                pa.float64() if isinstance(value, float) else pa.string())
            break
        lines.close()
        if self.id_field and self.id_type is None:  # no rows: the type does not matter
            self.id_type = pa.string()

    def _id(self, value):
        """(id, None) or (None, why not)."""
        t = self.id_type
        if isinstance(value, bool) or value is None:
            pass
        elif t == pa.string() and isinstance(value, (str, int)):
            return str(value), None
        elif t == pa.int64() and isinstance(value, int) and -2**63 <= value < 2**63:
            return value, None
        elif t == pa.float64() and isinstance(value, (int, float)):
            return float(value), None
        kind = {pa.string(): "a string", pa.int64(): "an integer", pa.float64(): "a number"}[t]
        return None, f"the id is {_json_type(value)}, not {kind} like the first row's"

    def blocks(self, done):
        texts: list[str | None] = []
        ids: list | None = [] if self.id_field else None
        errors: dict[int, str] = {}
        start = row = 0
        for number, line, cut in self._lines():
            if not cut and not line.strip():
                continue
            if done.row(row):
                if texts:
                    yield _Block(start, texts, ids, errors)
                    texts, ids, errors = [], [] if self.id_field else None, {}
                row += 1
                self.rows = start = row
                continue
            text = ident = reason = None
            if cut:
                reason = f"line {number:,} is over {MAX_LINE_BYTES >> 20} MiB"
            else:
                try:
                    obj = orjson.loads(line)
                except orjson.JSONDecodeError as exc:
                    obj = None
                    try:
                        line.decode("utf-8")
                        reason = f"line {number:,} is not JSON: {exc}"
                    except UnicodeDecodeError as bad:
                        reason = f"line {number:,} is not valid UTF-8 (byte {bad.start:,})"
                if reason is None and not isinstance(obj, dict):
                    reason = f"line {number:,} is {_json_type(obj)}, not a JSON object"
                if reason is None:
                    if self.id_field:
                        if self.id_field in obj:
                            ident, why = self._id(obj[self.id_field])
                            if why:
                                reason = f"line {number:,}: {why}"
                        else:
                            reason = f"line {number:,} has no field {self.id_field!r}"
                    if reason is None:
                        if self.text_field in obj:
                            text, why = check_text(obj[self.text_field])
                            if why:
                                reason = f"line {number:,}: {why}"
                        else:
                            reason = f"line {number:,} has no field {self.text_field!r}"
            if reason:
                errors[len(texts)] = reason
                text = None
            texts.append(text)
            if ids is not None:
                ids.append(ident)
            row += 1
            self.rows = row
            if len(texts) >= PARQUET_BATCH_ROWS:
                yield _Block(start, texts, ids, errors)
                start = row
                texts, ids, errors = [], [] if self.id_field else None, {}
        self.rows = row
        if texts:
            yield _Block(start, texts, ids, errors)


def _decode_column(column: pa.Array, what: str) -> tuple[list[str | None], dict[int, str]]:
    """A string or binary column's values as text, each checked as UTF-8 on its own."""
    if pa.types.is_large_string(column.type):
        column = column.cast(pa.large_binary())
    elif pa.types.is_string(column.type) or pa.types.is_string_view(column.type):
        column = column.cast(pa.binary())
    texts: list[str | None] = []
    errors: dict[int, str] = {}
    for i, raw in enumerate(column.to_pylist()):
        if raw is None:
            text, reason = None, f"the {what} is null"
        else:
            text, reason = _decode(raw)
        if reason:
            errors[i] = reason
        texts.append(text)
    return texts, errors


def _is_text(t: pa.DataType) -> bool:
    return (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
            or pa.types.is_large_binary(t) or pa.types.is_string_view(t))


class ParquetSource(Source):
    format = "parquet"

    def __init__(self, path, text_field: str, id_field: str | None) -> None:
        import pyarrow.parquet as pq

        super().__init__(path, text_field, id_field)
        try:
            self._pf = pq.ParquetFile(self.path)
        except (OSError, pa.ArrowException) as exc:
            raise SourceError(f"{self.path!r} is not a readable Parquet file: {exc}") from None
        schema = self._pf.schema_arrow
        names = ", ".join(repr(n) for n in schema.names[:20])
        for flag, name in (("--text-field", text_field), ("--id-field", id_field)):
            if name and schema.get_field_index(name) < 0:
                raise SourceError(f"{self.path!r} has no column {name!r} (its columns: {names}); name "
                                  f"the column with {flag}")
        text_type = schema.field(text_field).type
        if not _is_text(text_type):
            raise SourceError(f"{self.path!r}: column {text_field!r} is {text_type}, not text")
        if id_field:
            self.id_type = schema.field(id_field).type
        self.total_rows = self._pf.metadata.num_rows
        self._read = 0

    def fraction(self) -> float | None:
        return self._read / self.total_rows if self.total_rows else None

    def blocks(self, done):
        meta = self._pf.metadata
        columns = [self.text_field] + ([self.id_field] if self.id_field else [])
        start = 0
        for g in range(meta.num_row_groups):
            n = meta.row_group(g).num_rows
            if done.all(start, start + n):  # a resumed job reads no row group it has done
                start += n
                self._read = start
                continue
            row = start
            for batch in self._pf.iter_batches(PARQUET_BATCH_ROWS, row_groups=[g], columns=columns):
                texts, errors = _decode_column(batch.column(0), "text")
                ids = batch.column(1).to_pylist() if self.id_field else None
                yield _Block(row, texts, ids, errors)
                row += batch.num_rows
                self._read = row
            start += n
        self.rows = start


class _CountingFile(io.RawIOBase):
    """A file that counts the bytes read from it (pyarrow's CSV reader does not say where it is)."""

    def __init__(self, f) -> None:
        self._f = f
        self.read_bytes = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self._f.readinto(b)
        self.read_bytes += n or 0
        return n

    def close(self) -> None:
        self._f.close()
        super().close()


class CsvSource(Source):
    """A header row, then a row per record; values may span lines when quoted. Ids are read as
    strings (a CSV says nothing of types)."""

    format = "csv"

    def __init__(self, path, text_field: str, id_field: str | None) -> None:
        super().__init__(path, text_field, id_field)
        header = self._header()
        names = ", ".join(repr(n) for n in header[:20])
        for flag, name in (("--text-field", text_field), ("--id-field", id_field)):
            if name and name not in header:
                raise SourceError(f"{self.path!r} has no column {name!r} (its header: {names}); name "
                                  f"the column with {flag}")
        self.id_type = pa.string() if id_field else None
        self._counter: _CountingFile | None = None

    def _header(self) -> list[str]:
        import csv

        try:
            with open(self.path, newline="", encoding="utf-8", errors="replace") as f:
                return next(csv.reader(f), [])
        except OSError as exc:
            raise SourceError(f"{self.path!r}: {exc.strerror}") from None

    def _line_of(self, text: str) -> str:
        """Where a malformed record starts (pyarrow does not say once values may span lines)."""
        import csv

        width = len(self._header())
        with open(self.path, newline="", encoding="utf-8", errors="replace") as f:
            reader = csv.reader(f)
            start = 1
            for record in reader:
                if record and len(record) != width:
                    return f"line {start:,}"
                start = reader.line_num + 1
        return "a row"

    def fraction(self) -> float | None:
        if self._counter is None or not self.size:
            return None
        return min(1.0, self._counter.read_bytes / self.size)

    def blocks(self, done):
        import pyarrow.csv as pacsv

        bad: list = []

        def invalid_row(row) -> str:
            bad.append(row)
            return "error"

        columns = [self.text_field] + ([self.id_field] if self.id_field else [])
        types = {self.text_field: pa.binary()} | ({self.id_field: pa.string()} if self.id_field else {})
        try:
            raw = open(self.path, "rb")
        except OSError as exc:
            raise SourceError(f"{self.path!r}: {exc.strerror}") from None
        self._counter = _CountingFile(raw)
        stream = io.BufferedReader(self._counter, 1 << 20)
        row = 0
        try:
            reader = pacsv.open_csv(
                stream, read_options=pacsv.ReadOptions(block_size=CSV_BLOCK_BYTES),
                parse_options=pacsv.ParseOptions(newlines_in_values=True, invalid_row_handler=invalid_row),
                convert_options=pacsv.ConvertOptions(column_types=types, include_columns=columns))
            for batch in reader:
                n = batch.num_rows
                if done.all(row, row + n):
                    row += n
                    self.rows = row
                    continue
                texts, errors = _decode_column(batch.column(self.text_field), "text")
                ids = batch.column(self.id_field).to_pylist() if self.id_field else None
                self.rows = row + n
                yield _Block(row, texts, ids, errors)
                row += n
        except pa.ArrowInvalid as exc:
            if bad:
                b = bad[0]
                where = f"line {b.number:,}" if b.number is not None else self._line_of(b.text)
                raise SourceError(f"{self.path!r} {where}: expected {b.expected_columns} columns, found "
                                  f"{b.actual_columns}: {b.text[:200]!r}") from None
            raise SourceError(f"{self.path!r} is not a readable CSV file after row {row:,}: {exc}") from None
        finally:
            stream.close()
        self.rows = row


SOURCES = {"txt": TextSource, "jsonl": JsonlSource, "csv": CsvSource, "parquet": ParquetSource}


def open_source(path: str | os.PathLike, text_field: str, id_field: str | None) -> Source:
    return SOURCES[input_format(path)](path, text_field, id_field)
