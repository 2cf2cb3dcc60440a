"""The project's own workload: the length mix, bursty arrivals, and the JSONL format."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tokq.profiling import workload



def test_lengths_are_seeded_and_clipped():
    a = workload.query_lengths(20_000, seed=7)
    assert np.array_equal(a, workload.query_lengths(20_000, seed=7))
    assert not np.array_equal(a, workload.query_lengths(20_000, seed=8))
    assert a.min() >= workload.MIN_TOKENS and a.max() <= workload.MAX_TOKENS


def test_length_mix_is_short_queries_with_a_long_tail():
    lens = workload.query_lengths(100_000, seed=3)
    assert np.median(lens) == pytest.approx(10, abs=0.5)
    assert np.percentile(lens, 90) == pytest.approx(30, abs=2)
    # >= 100 tokens: the 0.5% tail plus the lognormal's own ~0.36% beyond 100
    assert 0.006 < np.mean(lens >= 100) < 0.012
    assert np.mean(lens >= 300) > 0.0005  # the log-uniform tail reaches far past the lognormal


def test_arrivals_burst_four_times_faster_for_one_second_in_five():
    times = workload.arrival_times_s(60_000, rate_per_s=200.0, seed=5)
    assert np.all(np.diff(times) > 0)
    in_burst = (times % 5.0) < 1.0
    num_periods = times[-1] / 5.0
    burst_rate = in_burst.sum() / num_periods  # arrivals per burst second
    calm_rate = (~in_burst).sum() / (num_periods * 4.0)
    assert calm_rate == pytest.approx(200.0, rel=0.05)
    assert burst_rate / calm_rate == pytest.approx(4.0, rel=0.08)


def test_rate_changes_arrivals_but_never_lengths():
    slow, fast = workload.generate(500, seed=2, rate_per_s=10), workload.generate(500, seed=2, rate_per_s=1000)
    assert [q.num_tokens for q in slow] == [q.num_tokens for q in fast]
    assert slow[-1].t_s > 10 * fast[-1].t_s


def test_jsonl_round_trip(tmp_path):
    queries = workload.generate(50, seed=4)
    queries[0] = workload.Query(id=0, num_tokens=5, t_s=0.1, text="hello there world")
    path = tmp_path / "w.jsonl"
    workload.write_jsonl(queries, path)
    assert workload.load_jsonl(path) == queries
    assert json.loads(path.read_text().splitlines()[0]) == {"id": 0, "text": "hello there world",
                                                            "tokens": 5, "t": 0.1}


@pytest.mark.parametrize("bad_line", ['{"id": 1, "text": "x"}', '{"id": 1, "tokens": 0}',
                                      '{"id": 1, "tokens": 4, "text": 12}', "not json"])
def test_bad_jsonl_line_is_named_by_line_number(tmp_path, bad_line):
    path = tmp_path / "w.jsonl"
    path.write_text('{"id": 0, "text": "ok", "tokens": 3, "t": 0.0}\n' + bad_line + "\n")
    with pytest.raises(ValueError, match=r"w\.jsonl:2"):
        workload.load_jsonl(path)


# JSON reads 1e400 as inf and NaN/Infinity as floats; true is an int to Python: none is a number here.
@pytest.mark.parametrize("bad_line, message", [
    ('{"id": 1, "tokens": 1e400}', "tokens must be finite, got inf"),
    ('{"id": 1, "tokens": 3, "t": NaN}', "t must be finite, got nan"),
    ('{"id": 1, "tokens": 3, "t": Infinity}', "t must be finite, got inf"),
    ('{"id": 1, "tokens": 3, "t": 1e400}', "t must be finite, got inf"),
    ('{"id": -Infinity, "tokens": 3}', "id must be finite, got -inf"),
    ('{"id": 1, "tokens": 3, "t": -0.5}', "t must be in 0..31,536,000, got -0.5"),
    ('{"id": -1, "tokens": 3}', "id must be in 0..9,223,372,036,854,775,807, got -1"),
    # json reads any integer: past a float's range, then past any model's length
    ('{"id": 1, "tokens": 1' + "0" * 400 + '}', "tokens must be in 1..1,048,576, got a 401-digit number"),
    ('{"id": 1, "tokens": 1000000000000000}', "tokens must be in 1..1,048,576, got 1000000000000000"),
    ('{"id": 1, "tokens": 3, "t": 1' + "0" * 400 + '}', "t must be in 0..31,536,000, got a 401-digit number"),
    ('{"id": 1, "tokens": true}', "tokens must be a number, got true"),
    ('{"id": true, "tokens": 3}', "id must be a number, got true"),
    ('{"id": 1, "tokens": 3, "t": false}', "t must be a number, got false"),
    ('{"id": 1, "tokens": "12"}', 'tokens must be a number, got "12"'),
    ('{"id": 1, "tokens": 2.5}', "tokens must be a whole number, got 2.5"),
    ('[1, 2]', "a line must be a JSON object, got list")])
def test_numbers_must_be_finite_non_negative_and_not_booleans(tmp_path, bad_line, message):
    path = tmp_path / "w.jsonl"
    path.write_text('{"id": 0, "text": "ok", "tokens": 3, "t": 0.0}\n' + bad_line + "\n")
    with pytest.raises(ValueError, match=r"w\.jsonl:2: ") as info:
        workload.load_jsonl(path)
    assert message in str(info.value)


def test_whole_floats_are_whole_numbers(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"id": 4.0, "tokens": 7.0, "t": 2}\n')
    assert workload.load_jsonl(path) == [workload.Query(id=4, num_tokens=7, t_s=2.0)]


def test_bytes_that_are_not_utf8_are_named_by_line_number(tmp_path):
    # Far past the first read buffer, where a decoder reading ahead would fail naming no line.
    lines = [b'{"id": %d, "text": "query %d", "tokens": 5}\n' % (i, i) for i in range(2000)]
    lines[1500] = b'{"id": 1500, "text": "caf\xe9", "tokens": 5}\n'  # latin-1
    path = tmp_path / "w.jsonl"
    path.write_bytes(b"".join(lines))
    with pytest.raises(ValueError, match=r"w\.jsonl:1501: .*not UTF-8: byte 0xe9 at character 26"):
        workload.load_jsonl(path)


def test_a_file_starting_with_a_utf8_bom_reads_like_one_without(tmp_path):
    # Some editors and Windows tools write one; json.loads refuses it ("Unexpected UTF-8 BOM").
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"id": 0, "text": "caf\xc3\xa9", "tokens": 5}\n')
    (query,) = workload.load_jsonl(path)
    assert (query.id, query.text, query.num_tokens) == (0, "caf\u00e9", 5)


def test_empty_workload_file_is_an_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match="no queries"):
        workload.load_jsonl(path)


@pytest.mark.skipif(not workload.SHARED_PATH.is_file(), reason="../shared/workloads/short_queries.jsonl absent")
def test_generator_matches_the_shared_workload():
    shared = workload.load_jsonl(workload.SHARED_PATH)
    ours = workload.generate(len(shared), seed=1, rate_per_s=200.0)
    # Same seed, same draw order: identical lengths.
    assert [q.num_tokens for q in ours] == [q.num_tokens for q in shared]
    # Arrivals come from another stream: compare their shape, not their values.
    span_ours, span_shared = ours[-1].t_s, shared[-1].t_s
    assert span_ours == pytest.approx(span_shared, rel=0.15)
    summary = workload.describe(shared)
    assert summary["has_texts"] and summary["p50_tokens"] == 10 and summary["p90_tokens"] == 30
