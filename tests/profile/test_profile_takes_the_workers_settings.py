"""`tokq profile` against the setups and settings the workers take: a Sentinel's address, an ACL
user without INFO (--redis-cluster / TOKQ_REDIS_CLUSTER), Redis gone during the sweep, the
fleet's TOKQ_LATENCY_GOAL_MS, a bad --device and TOKQ_THREADS=0. Each mistake is one line, no
traceback; where the CLI's output is the point, the command runs as its own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import redis
from click.testing import CliRunner

from tokq.queue.keys import QueueKeys
from tokq.model.info import ModelInfo
from tokq.profiling.profile.cli import profile_command
from tokq.redis.embedded import free_port

# 3 batch sizes (a knee needs 3), one repeat each: about a second once the model is loaded.
TINY = ["--min-tokens", "4", "--max-tokens", "16", "--points-per-doubling", "1", "--time-per-point-s", "0.05",
        "--min-repeats", "1", "--stop-ms", "60000", "--quiet"]


def _run(args: list[str], env: dict[str, str] | None = None,
         timeout_s: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TOKQ_DEVICE": "cpu", "TOKQ_THREADS": "1",
           **(env or {})}
    return subprocess.run([sys.executable, "-m", "tokq.cli", "profile", *args], capture_output=True,
                          text=True, env=env, timeout=timeout_s)


def _one_error_line(run: subprocess.CompletedProcess, needle: str, status: int = 1) -> str:
    """The one "Error: " line (exit status 1), or click's usage error (2): that line after the
    usage and --help hints."""
    lines = run.stderr.strip().splitlines()
    assert run.returncode == status and "Traceback" not in run.stderr, run.stderr[-3000:]
    hints = [line for line in lines[:-1] if line.startswith(("Usage: ", "Try ")) or not line]
    assert len(hints) == len(lines) - 1 == (0 if status == 1 else 3), run.stderr[-3000:]
    assert lines[-1].startswith("Error: ") and needle in lines[-1], lines[-1]
    return lines[-1]


def _budget(url: str) -> bytes | None:
    client = redis.Redis.from_url(url)
    try:
        return client.get(QueueKeys(ModelInfo.load().queue_name).budget)
    finally:
        client.close()


# --apply against a Sentinel, an ACL user without INFO, a Redis that stops during the sweep.

def test_apply_to_a_sentinel_is_one_line_naming_it_before_the_sweep(tmp_path):
    from cluster_support import running_sentinel

    with running_sentinel(tmp_path) as url:
        run = _run([*TINY, "--out", str(tmp_path / "p.json"), "--apply", "--redis-url", url])
    _one_error_line(run, "is a Sentinel")
    assert not (tmp_path / "p.json").exists()  # refused before the sweep


@pytest.fixture
def no_info_user(redis_server, redis_url):
    """A URL for an ACL user allowed everything but INFO (a managed Redis's restricted user)."""
    admin = redis.Redis.from_url(redis_url)
    admin.acl_setuser("profiler", enabled=True, passwords=["+profiler-pw"], keys=["*"], channels=["*"],
                      commands=["+@all", "-info"])
    try:
        yield f"redis://profiler:profiler-pw@127.0.0.1:{redis_server.port}/0"
    finally:
        admin.acl_deluser("profiler")
        admin.close()


def test_apply_as_a_user_without_info_says_to_set_redis_cluster(tmp_path, no_info_user):
    run = _run([*TINY, "--out", str(tmp_path / "p.json"), "--apply", "--redis-url", no_info_user])
    line = _one_error_line(run, "set --redis-cluster (TOKQ_REDIS_CLUSTER) to yes or no")
    assert "no Redis answers" not in line and "profiler-pw" not in run.stderr + run.stdout
    assert not (tmp_path / "p.json").exists()


@pytest.mark.slow
def test_apply_as_a_user_without_info_publishes_with_redis_cluster_no(tmp_path, no_info_user):
    run = _run([*TINY, "--slo-p99-ms", "1e9", "--out", str(tmp_path / "p.json"), "--apply",
                "--redis-url", no_info_user], {"TOKQ_REDIS_CLUSTER": "no"})
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr[-3000:]
    budget = json.loads((tmp_path / "p.json").read_text())["recommended_budget"]
    assert f"published token budget {budget}" in run.stdout and _budget(no_info_user) == str(budget).encode()

    # The flag too, and it wins over the env var (auto would stop at the probe, as above).
    redis.Redis.from_url(no_info_user).flushall()
    result = CliRunner().invoke(profile_command, ["--device", "cpu", "--threads", "1", *TINY, "--slo-p99-ms",
                                                  "1e9", "--out", str(tmp_path / "q.json"), "--apply",
                                                  "--redis-url", no_info_user, "--redis-cluster", "no"],
                                env={"TOKQ_REDIS_CLUSTER": "auto"})
    assert result.exit_code == 0, result.output
    budget = json.loads((tmp_path / "q.json").read_text())["recommended_budget"]
    assert _budget(no_info_user) == str(budget).encode()


def test_redis_cluster_takes_only_what_the_workers_take(tmp_path):
    run = _run([*TINY, "--out", str(tmp_path / "p.json"), "--apply"], {"TOKQ_REDIS_CLUSTER": "maybe"})
    _one_error_line(run, "TOKQ_REDIS_CLUSTER", status=2)
    assert "--redis-cluster" in CliRunner().invoke(profile_command, ["--help"]).output


@pytest.mark.slow
def test_redis_stopping_during_the_sweep_is_one_line_and_the_profile_is_still_written(tmp_path):
    from tokq.redis.embedded import EmbeddedRedis

    out, png = tmp_path / "p.json", tmp_path / "p.png"
    with EmbeddedRedis() as server:
        watcher = redis.Redis.from_url(server.url)
        watcher.config_resetstat()
        proc = subprocess.Popen([sys.executable, "-m", "tokq.cli", "profile", *TINY, "--slo-p99-ms", "1e9",
                                 "--out", str(out), "--plot", str(png), "--apply", "--redis-url", server.url],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONWARNINGS": "ignore", "TOKQ_DEVICE": "cpu",
                                     "TOKQ_THREADS": "1"})
        try:
            # The check before the sweep ends with a PING; the model loads after it.
            deadline = time.monotonic() + 60
            while "cmdstat_ping" not in watcher.info("commandstats"):
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
                time.sleep(0.01)
            watcher.close()
            server.stop()
            stdout, stderr = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    run = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    line = _one_error_line(run, "not published")
    assert "ConnectionError" in line and ":***@127.0.0.1" in line and server.password not in stderr
    assert json.loads(out.read_text())["recommended_budget"] and png.exists()
    assert f"wrote {out} and {png}" in stdout


# The fleet's latency goal.

def _profile(tmp_path, args, env=None, threads=("--threads", "1")):
    out = tmp_path / "p.json"
    result = CliRunner().invoke(profile_command, ["--device", "cpu", *threads, *TINY, "--out", str(out),
                                                  *args], env=env)
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def test_the_slo_default_is_the_fleets_latency_goal(tmp_path):
    assert _profile(tmp_path, [], {"TOKQ_LATENCY_GOAL_MS": "2"})["slo_p99_ms"] == 2
    # A flag wins; 0, the workers' "no goal", leaves profile its own default.
    assert _profile(tmp_path, ["--slo-p99-ms", "1e9"], {"TOKQ_LATENCY_GOAL_MS": "2"})["slo_p99_ms"] == 1e9
    assert _profile(tmp_path, [], {"TOKQ_LATENCY_GOAL_MS": "0"})["slo_p99_ms"] == 500
    help_text = " ".join(CliRunner().invoke(profile_command, ["--help"]).output.split())
    assert "TOKQ_LATENCY_GOAL_MS" in help_text


@pytest.mark.parametrize("value", ["-5", "fast"])
def test_a_bad_latency_goal_in_the_env_is_one_line_naming_it(tmp_path, value):
    run = _run([*TINY, "--out", str(tmp_path / "p.json")], {"TOKQ_LATENCY_GOAL_MS": value})
    _one_error_line(run, "TOKQ_LATENCY_GOAL_MS", status=2)


# --device and --threads, checked as the worker checks them.

@pytest.mark.parametrize("args, env", [(["--device", "gpu"], {}), ([], {"TOKQ_DEVICE": "gpu"})])
def test_a_bad_device_is_one_line_before_anything_loads(tmp_path, args, env):
    # A model that does not exist: its error would come first were the device checked after.
    run = _run(["--model", str(tmp_path / "no-such-model"), *args, "--out", str(tmp_path / "p.json")], env)
    _one_error_line(run, "device='gpu' is not auto | cpu | cuda | cuda:N (flag --device, env TOKQ_DEVICE)",
                    status=2)


def test_threads_0_is_the_workers_choice(tmp_path):
    from tokq.workers.device import worker_threads

    assert _profile(tmp_path, [], {"TOKQ_THREADS": "0"}, threads=())["threads"] == worker_threads(0)
    run = _run([*TINY, "--out", str(tmp_path / "p.json")], {"TOKQ_THREADS": "-1"})
    _one_error_line(run, "(flag --threads, env TOKQ_THREADS)", status=2)
