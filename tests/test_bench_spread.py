"""`tokq bench spread`: the figures it reports are taken from the numbers
(medians over rounds, ratios within a round), and one real measurement against `--procs 2`."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from tokq.profiling.bench import spread as bench_spread


def result(rnd: int, transport: str, procs: int, clients: int, rate: float, split: list[float]) -> dict:
    cores = {"worker": 0.5, "redis": 0.1, **{f"gateway process {i + 1}": 0.3 for i in range(procs)},
             **{f"client {i + 1}": 0.4 for i in range(clients)}}
    return {"round": rnd, "transport": transport, "gateway_procs": procs, "client_procs": clients,
            "calls_per_s": rate, "split": split, "cores": cores, "machine_cores_busy": 1.9, "client_errors": 0}


def report(results: list[dict]) -> dict:
    return {"seconds": 8.0, "concurrency": 32, "rounds": 3, "results": results, "loadavg": ["2.0", "2.0", "2.0"],
            "cpus": os.cpu_count(), "python": "3.11", "date": "2026-01-01 00:00 UTC"}


def test_ratios_are_taken_within_a_round_and_medians_over_rounds():
    # Round 2 is slow for both (other load): its ratio still counts as 1.2x.
    rows = bench_spread.medians(report([
        result(0, "grpc", 1, 1, 1000, [1000]), result(0, "grpc", 2, 1, 1100, [560, 540]),
        result(1, "grpc", 1, 1, 500, [500]), result(1, "grpc", 2, 1, 600, [290, 310]),
        result(2, "grpc", 1, 1, 1000, [1000]), result(2, "grpc", 2, 1, 1300, [600, 700]),
    ]))
    two = next(r for r in rows if r["gateway_procs"] == 2)
    assert two["vs_procs_1"] == pytest.approx(1.2) and two["calls_per_s"] == 1100
    assert two["busiest_share"] == pytest.approx(310 / 600)


def test_section_says_the_split_the_ratio_and_the_machine():
    text = bench_spread.markdown_section(report([
        result(0, "grpc", 1, 1, 1000, [1000]), result(0, "grpc", 2, 1, 1500, [760, 740]),
        result(0, "grpc", 1, 2, 1200, [1200]), result(0, "grpc", 2, 2, 1800, [900, 900]),
    ]), "tokq bench spread")
    assert text.startswith(bench_spread.SECTION_START) and text.rstrip().endswith(bench_spread.SECTION_END)
    assert "| grpc | 2 | 1 | 1,500 | 1.50x | 51% | 0.30 + 0.30 | 0.50 | 0.10 | 0.40 | 0.30 | 0 |" in text
    assert "One client against `--procs 2`: 1.50x" in text and "Two client processes: 1.50x" in text
    assert f"shared {os.cpu_count()}-CPU machine" in text and "load average" in text


@pytest.mark.slow
def test_one_client_against_two_gateway_processes_end_to_end(tmp_path):
    out, results = tmp_path / "spread.json", tmp_path / "RESULTS.md"
    args = ["--seconds", "1.0", "--concurrency", "4", "--rounds", "1", "--config", "grpc:2:1", "--json", str(out),
            "--results-md", str(results)]
    result_ = CliRunner().invoke(bench_spread.spread_command, args, catch_exceptions=False)
    assert result_.exit_code == 0, result_.output
    text = results.read_text()
    assert text.count(bench_spread.SECTION_START) == 1 and f"`tokq bench spread {' '.join(args)}`" in text
    (only,) = json.loads(out.read_text())["results"]
    assert len(only["split"]) == 2 and min(only["split"]) > 0 and only["client_errors"] == 0
    assert set(only["cores"]) == {"worker", "redis", "gateway process 1", "gateway process 2", "client 1"}
    assert all(v >= 0 for v in only["cores"].values())


def test_bad_config_is_a_usage_error():
    result_ = CliRunner().invoke(bench_spread.spread_command, ["--config", "grpc:two:1"])
    assert result_.exit_code == 2 and "--config" in result_.output
