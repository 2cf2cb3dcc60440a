"""The gateway benchmarks (`tokq bench gateway-cpu`, `http-cpu`, `spread`), each run on a real stack
at its smallest size; and the gateway CPU report's verdicts, from its numbers."""

from __future__ import annotations

import functools
import json
import re

import pytest

from tokq.profiling.bench import gateway_cpu, http_cpu, spread

pytestmark = pytest.mark.slow


def test_gateway_cpu(bench, tmp_path):
    args = ["--calls", "80", "--rates", "50", "--concurrency", "0", "--rounds", "1", "--warmup-calls", "10",
            "--profile-dir", str(tmp_path / "profile"), "--json", str(tmp_path / "g.json")]
    text = bench(gateway_cpu.gateway_cpu_command, args, f"{gateway_cpu.BLOCK} ({harness_extension()})")
    # gateway and bare ms per call, then calls/s per gateway core (the gateway's cores busy)
    assert re.search(r"^\| 50 req/s \| [\d.]+ \| [\d.]+ \| [\d,]+ \([\d.]+\) \| \*\*[\d.]+x\*\* \(", text, re.M)
    assert "| 50 req/s | gateway (tokq run) |" in text and "| 50 req/s | echo server (echo run) |" in text
    assert "### Where the gateway's CPU goes" in text and (tmp_path / "profile" / "gateway-pyspy.txt.gz").is_file()
    assert "Collapsed stacks: [gateway-pyspy.txt.gz](profile/gateway-pyspy.txt.gz)." in text
    assert "| self: Python function running" in text and "| total: Python function, inclusive" in text
    report = json.loads((tmp_path / "g.json").read_text())
    (only,) = report["loads"][0]["rounds"]
    assert only["tokq"]["summary"]["num_ok"] == 80 and only["tokq"]["counters"]["enqueues"] >= 80
    # the target is judged on the median gateway CPU of a load, only where no call failed
    only["tokq"]["cpu_ms_per_call"]["gateway"] = 0.5
    assert gateway_cpu.verdict([only]) == "met"
    only["tokq"]["summary"]["errors"] = {"DEADLINE_EXCEEDED": 1}
    assert gateway_cpu.verdict([only]) == "not judged: some calls failed"


def harness_extension() -> str:
    from tokq.host import vector_extension

    return vector_extension()


def test_http_cpu(bench, monkeypatch):
    monkeypatch.setattr(http_cpu, "WARMUP", 20)
    monkeypatch.setattr(http_cpu, "json_encoding", functools.partial(http_cpu.json_encoding, 50))
    text = bench(http_cpu.http_cpu_command, ["--calls", "200", "--rounds", "1"], http_cpu.BLOCK)
    assert re.search(r"^\| gateway \| [\d.]+ \| [\d.]+ \|", text, re.M)
    assert "Gateway HTTP/gRPC CPU ratio per call: median" in text and "orjson" in text


def test_http_cpu_report_without_a_measurable_grpc_round():
    def round_(grpc_ms, http_ms):
        return {k: {"cpu_ms_per_call": {"gateway": v}, "calls_per_s": 100.0} for k, v in (("grpc", grpc_ms), ("http", http_ms))}
    report = {"calls": 20, "concurrency": 8, "rounds": [round_(0.0, 0.5)], "loadavg": ["1.0"] * 3, "cpus": 2,
              "python": "3.11", "date": "today", "json": {"orjson_us": 1.0, "json_us": 20.0, "json_over_orjson": 20.0}}
    assert "ratio per call: not measured" in http_cpu.markdown_section(report, "tokq bench http-cpu")
    report["rounds"].append(round_(0.4, 0.5))
    assert "ratio per call: median 1.25x (rounds: 1.25)" in http_cpu.markdown_section(report, "tokq bench http-cpu")


def test_spread(bench):
    args = ["--seconds", "0.5", "--concurrency", "4", "--config", "grpc:2:1", "--rounds", "1"]
    text = bench(spread.spread_command, args, spread.BLOCK)
    assert f"`tokq bench spread {' '.join(args)} --results-md" in text
    row = next(line for line in text.splitlines() if line.startswith("| grpc | 2 | 1 |"))
    assert "–" not in row.split("|")[6]  # the busiest process's share: both processes took calls
    assert "- The machine's" in text
