"""The HTTP-vs-gRPC CPU benchmark's report: per-round ratios, medians, a section it can rewrite."""

from __future__ import annotations

import os

from tokq.profiling.bench.http_cpu import BLOCK, SECTION_END, SECTION_START, markdown_section
from tokq.profiling.results_md import write_block


def _round(grpc_ms: float, http_ms: float) -> dict:
    return {kind: {"cpu_ms_per_call": {"gateway": ms, "redis": 0.5}, "calls_per_s": 40.0}
            for kind, ms in (("grpc", grpc_ms), ("http", http_ms))}


def test_ratio_is_the_median_of_per_round_ratios_and_the_section_is_rewritten(tmp_path):
    report = {"calls": 10, "concurrency": 2, "rounds": [_round(2.0, 3.0), _round(1.0, 1.0), _round(4.0, 5.0)],
              "json": {"orjson_us": 20.0, "json_us": 900.0, "json_over_orjson": 45.0},
              "loadavg": ["1.0", "1.0", "1.0"], "cpus": os.cpu_count(), "python": "3.11", "date": "today"}
    section = markdown_section(report, "tokq bench http-cpu")
    assert "median 1.25x (rounds: 1.50, 1.00, 1.25)" in section  # not the ratio of medians (1.33)
    assert "| gateway | 2.000 | 3.000 |" in section and f"shared {os.cpu_count()}-CPU machine" in section
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\nkept\n")
    write_block(results, BLOCK, section)
    write_block(results, BLOCK, section.replace("today", "tomorrow"))
    text = results.read_text()
    assert text.count(SECTION_START) == 1 and text.count(SECTION_END) == 1
    assert "kept" in text and "tomorrow" in text and "today" not in text
