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
