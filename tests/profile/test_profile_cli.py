"""`tokq profile` end to end on this machine's CPU with the bundled all-MiniLM-L6-v2: a short
grid, a JSON report and a figure that opens, and --apply publishing where workers read it."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis
import redis.asyncio as aioredis
import torch
from click.testing import CliRunner
from matplotlib.image import imread

from tokq.queue.keys import QueueKeys
from tokq.model.info import ModelInfo
from tokq.profiling import workload
from tokq.profiling.profile.cli import profile_command

# 5 batch sizes (16..256 tokens), 3+ repeats each: a few seconds on 2 shared cores. One thread:
# on a busy machine, two-thread ops stall on each other (measured 70x slower at 16 tokens).
SHORT_GRID = ["--device", "cpu", "--threads", "1", "--min-tokens", "16", "--max-tokens", "256", "--points-per-doubling", "1",
              "--time-per-point-s", "0.1", "--min-repeats", "3", "--stop-ms", "60000", "--quiet"]


def invoke(args):
    result = CliRunner().invoke(profile_command, args, catch_exceptions=False)
    return result


def published_budget(redis_url: str, queue_name: str) -> int | None:
    """The budget as a running worker reads it (tokq.queue.shard.Queue.get_budget)."""
    from tokq.queue.shard import Queue

    async def read() -> int | None:
        client = aioredis.Redis.from_url(redis_url)
        try:
            return await Queue(client, queue_name).get_budget()
        finally:
            await client.aclose()

    return asyncio.run(read())


def test_cpu_profile_writes_json_and_plot_and_applies_the_budget(tmp_path, redis_url):
    out, png = tmp_path / "profile.json", tmp_path / "profile.png"
    # A goal every batch meets: the budget is then where throughput stops growing.
    result = invoke(SHORT_GRID + ["--slo-p99-ms", "1e9", "--out", str(out), "--plot", str(png),
                                  "--apply", "--redis-url", redis_url])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["model"] == "all-MiniLM-L6-v2" and report["queue_name"] == ModelInfo.load().queue_name
    assert report["device"] == "cpu" and report["dtype"] == "float32" and report["torch_version"]
    assert len(report["load_average"]) == 2
    assert report["threads"] == 1 and "1 thread" in report["device_name"]
    assert [p["num_tokens"] for p in report["points"]] == [16, 32, 64, 128, 256]
    assert all(p["median_ms"] > 0 and p["num_repeats"] >= 3 and p["gflop_per_s"] > 0 for p in report["points"])
    assert report["stopped_reason"] is None and report["duration_s"] > 0
    assert report["fit"]["kind"] in ("knee", "flat", "linear") and report["flat_ms"] > 0
    assert report["slo_p99_ms"] == 1e9 and report["max_batch_ms"] == 5e8
    rec = report["recommendation"]
    assert rec["latency_cap_tokens"] == 256 and rec["limited_by"] in ("throughput", "grid")
    assert report["recommended_budget"] == min(rec["throughput_cap_tokens"], 256)
    assert report["summary"] in result.output
    assert "limited by" in result.output and "latency goal (p99)" in result.output  # the rich table

    height, width = imread(png).shape[:2]
    assert (height, width) == (700, 800)

    key = QueueKeys(ModelInfo.load().queue_name).budget
    budget = report["recommended_budget"]
    assert redis.Redis.from_url(redis_url).get(key) == str(budget).encode()
    assert published_budget(redis_url, ModelInfo.load().queue_name) == budget
    assert f"published token budget {budget}" in result.output


def test_profile_uses_a_workload_files_texts(tmp_path, bundled_model_dir):
    queries = [workload.Query(id=i, num_tokens=3, t_s=i * 0.01, text=f"query number {i} about redis queues")
               for i in range(40)]
    path = tmp_path / "mine.jsonl"
    workload.write_jsonl(queries, path)
    out = tmp_path / "p.json"
    args = SHORT_GRID[:] + ["--workload", str(path), "--out", str(out)]
    args[args.index("--max-tokens") + 1] = "64"
    result = invoke(args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["workload"]["token_ids"] == "text" and report["workload"]["num_queries"] == 40
    assert report["workload"]["source"] == str(path)
    assert [p["num_tokens"] for p in report["points"]] == [16, 32, 64]
    # The texts are 9-10 tokens with [CLS]/[SEP], not the file's "tokens": 3.
    assert report["points"][-1]["num_seqs"] < 64 // 3


def test_apply_refuses_when_no_batch_fits_the_ceiling(tmp_path, redis_url):
    args = SHORT_GRID[:] + ["--slo-p99-ms", "0.000001", "--out", str(tmp_path / "p.json"),
                            "--apply", "--redis-url", redis_url]
    args[args.index("--max-tokens") + 1] = "64"
    result = CliRunner().invoke(profile_command, args)
    assert result.exit_code == 1
    assert "no budget to apply" in result.output
    assert redis.Redis.from_url(redis_url).get(QueueKeys(ModelInfo.load().queue_name).budget) is None
    assert json.loads((tmp_path / "p.json").read_text())["recommended_budget"] is None


@pytest.mark.slow
def test_apply_with_no_redis_answering_fails_before_the_sweep_naming_the_url_masked(tmp_path):
    from tokq.redis.embedded import free_port

    url = f"redis://:s3cret-pw@127.0.0.1:{free_port()}/0"  # nothing listens there
    result = CliRunner().invoke(profile_command, SHORT_GRID + ["--out", str(tmp_path / "p.json"), "--apply",
                                                               "--redis-url", url])
    assert result.exit_code == 1, result.output
    assert "Redis at redis://:***@127.0.0.1" in result.output and "did not answer" in result.output
    assert "s3cret-pw" not in result.output
    assert not (tmp_path / "p.json").exists()  # refused before the sweep, not after it


def test_a_redis_password_typed_on_the_command_line_is_masked_in_output_and_results(tmp_path):
    from tokq.redis.embedded import EmbeddedRedis

    results = tmp_path / "RESULTS.md"
    with EmbeddedRedis() as server:  # a generated password, as tokq up's
        password = server.password
        args = ["--device", "cpu", "--min-tokens", "4", "--max-tokens", "16", "--points-per-doubling", "1",
                "--time-per-point-s", "0.05", "--min-repeats", "1", "--out", str(tmp_path / "p.json"),
                "--threads", "1", "--results-md", str(results), "--quiet", "--slo-p99-ms", "1e9",
                "--apply", "--redis-url", server.url]
        result = invoke(args)
    assert result.exit_code == 0, result.output
    assert "published token budget" in result.output and ":***@127.0.0.1" in result.output
    assert password not in result.output and password not in results.read_text()
    assert "--redis-url 'redis://:***@127.0.0.1" in results.read_text()


@pytest.mark.parametrize("args, message", [(["--min-tokens", "64", "--max-tokens", "16"], "min_tokens"),
                                           (["--min-repeats", "0"], "min_repeats"),
                                           (["--num-queries", "0"], "--num-queries"),
                                           (["--out", "/nonexistent/p.json"], "its folder does not exist"),
                                           (["--slo-p99-ms", "0"], "slo-p99-ms")])
def test_bad_sweep_flags_are_usage_errors(args, message):
    result = CliRunner().invoke(profile_command, ["--device", "cpu", *args])
    assert result.exit_code == 2 and message in result.output


@pytest.mark.parametrize("bad_line, message", [(b'{"tokens": 1e400}', "tokens must be finite, got inf"),
                                               (b'{"tokens": 3, "t": NaN}', "t must be finite, got nan"),
                                               (b'{"tokens": 3, "text": "caf\xe9"}', "not UTF-8: byte 0xe9")])
def test_a_bad_workload_line_is_a_usage_error_naming_file_and_line(tmp_path, bad_line, message):
    path = tmp_path / "w.jsonl"
    path.write_bytes(b'{"tokens": 3}\n' + bad_line + b"\n")
    result = CliRunner().invoke(profile_command, ["--device", "cpu", "--workload", str(path),
                                                  "--out", str(tmp_path / "p.json")])
    assert result.exit_code == 2 and result.exception.__class__ is SystemExit, result.output
    error = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and "w.jsonl:2: " in error[0] and message in error[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_cuda_on_a_machine_without_one_is_a_clear_error(tmp_path):
    result = CliRunner().invoke(profile_command, ["--device", "cuda", "--out", str(tmp_path / "p.json")])
    assert result.exit_code == 1 and "CUDA is not available" in result.output
    assert not (tmp_path / "p.json").exists()


def test_results_md_gets_one_block_per_model_and_device_with_its_command(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\nkept\n")
    args = ["--device", "cpu", "--min-tokens", "4", "--max-tokens", "16", "--points-per-doubling", "1",
            "--time-per-point-s", "0.05", "--min-repeats", "1", "--out", str(tmp_path / "p.json"),
            "--threads", "1", "--results-md", str(results), "--quiet"]
    for _ in range(2):
        result = invoke(args)
        assert result.exit_code == 0, result.output
    text = results.read_text()
    report = json.loads((tmp_path / "p.json").read_text())
    assert text.startswith("# Results\n\nkept\n")
    assert text.count(f"<!-- tokq profile ({report['model']}, cpu): start") == 1
    assert f"Command: `tokq profile {' '.join(args)}`" in text and report["summary"] in text
    assert f"**{report['recommended_budget']} tokens**" in text
