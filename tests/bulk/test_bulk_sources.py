"""`tokq embed-file`'s input readers: rows in order and cut into chunks, per-row failures named by
line, whole-file problems refused before any work, done chunks skipped on resume, and memory that
stays bounded however large the file."""

from __future__ import annotations

import json
import os
import tracemalloc

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from tokq.bulk.sources import SourceError, open_source


def rows_of(source, n: int = 4, done: set[int] = frozenset()):
    """(row, text or None, id, reason) for every row the chunks carry."""
    out = []
    for chunk in source.chunks(n, set(done)):
        assert chunk.start == chunk.index * n
        for i, text in enumerate(chunk.texts):
            out.append((chunk.start + i, text, chunk.ids[i] if chunk.ids is not None else None,
                        chunk.errors.get(i)))
    return out


def test_txt_is_a_row_per_line_with_bad_lines_named(tmp_path):
    path = tmp_path / "in.txt"
    path.write_bytes(b"alpha\r\nbeta\n\n\xff\xfe bad\ngamma\ndelta")
    source = open_source(path, "text", None)
    rows = rows_of(source, n=2)
    assert [r[1] for r in rows] == ["alpha", "beta", None, None, "gamma", "delta"]
    assert rows[2][3] == "line 3 is empty"
    assert rows[3][3] == "line 4: not valid UTF-8 (byte 0 of the text)"
    assert source.rows == 6 and source.complete
    with pytest.raises(SourceError, match="--id-field needs"):
        open_source(path, "text", "id")


def test_chunks_skip_the_done_ones_and_keep_row_numbers(tmp_path):
    path = tmp_path / "in.txt"
    path.write_text("".join(f"row {i}\n" for i in range(10)))
    rows = rows_of(open_source(path, "text", None), n=3, done={0, 2})
    assert [r[0] for r in rows] == [3, 4, 5, 9]
    assert [r[1] for r in rows] == ["row 3", "row 4", "row 5", "row 9"]
    source = open_source(path, "text", None)
    assert rows_of(source, n=3, done={0, 1, 2, 3}) == [] and source.rows == 10


def test_jsonl_rows_ids_and_failures_named_by_line(tmp_path):
    path = tmp_path / "in.jsonl"
    lines = [json.dumps({"id": 1, "text": "one"}), "", "{broken", json.dumps({"id": 3}),
             json.dumps({"id": "x", "text": "id of another type"}), json.dumps([1, 2]),
             json.dumps({"id": 6, "text": 6}), json.dumps({"id": 7, "text": ""}),
             json.dumps({"id": 8, "text": None}), json.dumps({"id": 9, "text": "nine"})]
    path.write_text("\n".join(lines) + "\n\n")
    source = open_source(path, "text", "id")
    assert source.id_type == pa.int64()
    rows = rows_of(source)
    assert [r[0] for r in rows] == list(range(9))  # the blank lines are not rows
    assert [r[1] for r in rows] == ["one", None, None, None, None, None, None, None, "nine"]
    assert [r[2] for r in rows] == [1, None, 3, None, None, 6, 7, 8, 9]
    reasons = [r[3] for r in rows]
    assert reasons[1].startswith("line 3 is not JSON")
    assert reasons[2] == "line 4 has no field 'text'"
    assert reasons[3] == "line 5: the id is a string, not an integer like the first row's"
    assert reasons[4] == "line 6 is an array, not a JSON object"
    assert reasons[5] == "line 7: the text is a int, not a string"
    assert reasons[6] == "line 8: empty text"
    assert reasons[7] == "line 9: the text is null"
    assert source.rows == 9


def test_jsonl_first_row_without_the_field_is_refused_naming_the_fields(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"body": "x", "key": 1}) + "\n")
    with pytest.raises(SourceError, match=r"line 1 has no field 'text' \(its fields: 'body', 'key'\); "
                                          "name the field with --text-field"):
        open_source(path, "text", None)
    with pytest.raises(SourceError, match="no field 'doc_id'.*--id-field"):
        open_source(path, "body", "doc_id")
    path.write_text('["not", "an object"]\n')
    with pytest.raises(SourceError, match="line 1 is an array, not a JSON object"):
        open_source(path, "text", None)
    path.write_text('{"text": "ok", "id": [1]}\n')
    with pytest.raises(SourceError, match="ids must be strings or numbers"):
        open_source(path, "text", "id")


def test_jsonl_string_ids_take_numbers_as_strings(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": "a", "text": "x"}\n{"id": 2, "text": "y"}\n')
    source = open_source(path, "text", "id")
    assert source.id_type == pa.string()
    assert [r[2] for r in rows_of(source)] == ["a", "2"]


def test_csv_quoted_newlines_bad_utf8_and_string_ids(tmp_path):
    path = tmp_path / "in.csv"
    path.write_bytes(b'id,text,other\n1,"two\nlines",x\n2,\xff bad,y\n3,"",z\n4,plain,w\n')
    source = open_source(path, "text", "id")
    rows = rows_of(source, n=3)
    assert [r[1] for r in rows] == ["two\nlines", None, None, "plain"]
    assert [r[2] for r in rows] == ["1", "2", "3", "4"]
    assert rows[1][3].startswith("not valid UTF-8") and rows[2][3] == "empty text"
    assert source.rows == 4


def test_csv_missing_column_and_malformed_row_are_refused(tmp_path):
    path = tmp_path / "in.csv"
    path.write_text("body,id\nx,1\n")
    with pytest.raises(SourceError, match=r"no column 'text' \(its header: 'body', 'id'\)"):
        open_source(path, "text", None)
    path.write_text("text,id\nfine,1\nbad,2,extra\nfine,3\n")
    with pytest.raises(SourceError, match="line 3: expected 2 columns, found 3"):
        rows_of(open_source(path, "text", "id"))


def test_parquet_text_types_nulls_and_row_groups_skipped_on_resume(tmp_path):
    path = tmp_path / "in.parquet"
    table = pa.table({"text": pa.array(["a", None, "c", "d", "e", "f", "g"], pa.large_string()),
                      "key": pa.array([10, 11, 12, 13, 14, 15, 16], pa.int32())})
    pq.write_table(table, path, row_group_size=2)
    source = open_source(path, "text", "key")
    assert source.total_rows == 7 and source.id_type == pa.int32()
    rows = rows_of(source, n=2)
    assert [r[1] for r in rows] == ["a", None, "c", "d", "e", "f", "g"]
    assert rows[1][3] == "the text is null" and [r[2] for r in rows][:2] == [10, 11]
    rows = rows_of(open_source(path, "text", "key"), n=2, done={0, 2})
    assert [r[0] for r in rows] == [2, 3, 6]
    binary = tmp_path / "bin.parquet"
    pq.write_table(pa.table({"text": pa.array([b"ok", b"\xff"], pa.binary())}), binary)
    rows = rows_of(open_source(binary, "text", None))
    assert rows[0][1] == "ok" and rows[1][3].startswith("not valid UTF-8")


def test_parquet_missing_or_non_text_column_is_refused(tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"body": ["x"], "n": [1]}), path)
    with pytest.raises(SourceError, match=r"no column 'text' \(its columns: 'body', 'n'\)"):
        open_source(path, "text", None)
    with pytest.raises(SourceError, match="column 'n' is int64, not text"):
        open_source(path, "n", None)
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(SourceError, match="not a readable Parquet file"):
        open_source(tmp_path / "junk.parquet", "text", None)


def test_unknown_extension_and_unreadable_file(tmp_path):
    with pytest.raises(SourceError, match="unknown input format '.xml'"):
        open_source(tmp_path / "in.xml", "text", None)
    with pytest.raises(SourceError, match="No such file"):
        open_source(tmp_path / "gone.jsonl", "text", None)


def test_a_line_over_the_cap_fails_as_a_row_without_being_held(tmp_path, monkeypatch):
    import tokq.bulk.sources as sources

    monkeypatch.setattr(sources, "MAX_LINE_BYTES", 1024)
    path = tmp_path / "in.txt"
    path.write_text("short\n" + "x" * 5000 + "\nafter\n")
    rows = rows_of(open_source(path, "text", None))
    assert [r[1] for r in rows] == ["short", None, "after"]
    assert rows[1][3] == "line 2 is over 0 MiB"


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "csv"])
def test_reading_a_large_file_keeps_memory_bounded(tmp_path, fmt):
    """~40 MB of rows read in chunks: Python's and Arrow's peak allocations do not grow past the
    first tenth of the file, and stay well under its size."""
    rows = 80_000
    texts = [os.urandom(240).hex() for _ in range(10_000)]  # 480 bytes a row, not compressible
    path = tmp_path / f"big.{fmt}"
    if fmt == "jsonl":
        with open(path, "w") as f:
            for i in range(rows):
                f.write(json.dumps({"id": i, "text": texts[i % 10_000]}) + "\n")
    else:
        batch = pa.table({"id": pa.array(range(10_000), pa.int64()), "text": texts})
        if fmt == "parquet":
            with pq.ParquetWriter(path, batch.schema, compression="none", use_dictionary=False) as w:
                for _ in range(rows // 10_000):
                    w.write_table(batch, row_group_size=2_000)
        else:
            with pacsv.CSVWriter(path, batch.schema) as w:
                for _ in range(rows // 10_000):
                    w.write_table(batch)
    size = path.stat().st_size
    assert size > 35e6
    pool = pa.default_memory_pool()
    arrow_before = pool.bytes_allocated()
    source = open_source(path, "text", "id")
    tracemalloc.start()
    try:
        seen = arrow_peak = 0
        early = None
        for chunk in source.chunks(2048, set()):
            seen += len(chunk.texts)
            arrow_peak = max(arrow_peak, pool.bytes_allocated() - arrow_before)
            if early is None and seen >= rows // 10:
                early = (tracemalloc.get_traced_memory()[1], arrow_peak)
        _, python_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert seen == rows and source.rows == rows
    assert python_peak <= 1.25 * early[0] + 2e6, f"Python memory grew: {early[0] / 1e6:.1f} -> {python_peak / 1e6:.1f} MB"
    assert arrow_peak <= 1.25 * early[1] + 2e6, f"Arrow memory grew: {early[1] / 1e6:.1f} -> {arrow_peak / 1e6:.1f} MB"
    assert python_peak + arrow_peak < 0.5 * size, (
        f"peak {python_peak / 1e6:.1f} MB (Python) + {arrow_peak / 1e6:.1f} MB (Arrow) for {size / 1e6:.0f} MB")
