"""A real Prometheus (Debian's `prometheus`) scrapes tokq on loopback, evaluates the committed
recording rules, and answers every dashboard query; then the same against a running `tokq up`
with real traffic."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from tokq import metrics
from tokq.processes import stop_all
from tokq.redis.embedded import free_port, free_port_block

ROOT = Path(__file__).resolve().parents[2]
PROM_DIR = ROOT / "deploy" / "prometheus"
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
PROMETHEUS = shutil.which("prometheus")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus not installed (Debian: apt-get install -y prometheus)")]


def loopback_config(targets: dict[str, list[str]], tmp_path: Path) -> Path:
    """The committed prometheus.yml with each job's service discovery swapped for loopback
    targets, the committed rules, and 1 s intervals so a test needs seconds, not minutes."""
    config = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(PROM_DIR / pattern) for pattern in config["rule_files"]]
    for job in config["scrape_configs"]:
        job.pop("dns_sd_configs")
        job["static_configs"] = [{"targets": targets[job["job_name"]]}]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@contextmanager
def prometheus(config: Path, tmp_path: Path):
    port = free_port()
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until(lambda: _get(f"{url}/-/ready") is not None, 30, proc)
        yield url
    finally:
        stop_all([proc], timeout_s=10)
        proc.stderr.close()


def _get(url: str):
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.read()
    except OSError:
        return None


def _wait_until(check, timeout_s: float, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited: {proc.stderr.read().decode() if proc.stderr else ''}")
        result = check()
        if result:
            return result
        time.sleep(0.5)
    raise TimeoutError(f"not true within {timeout_s} s: {check}")


def query(url: str, expr: str) -> list[dict]:
    try:
        with urllib.request.urlopen(f"{url}/api/v1/query?"
                                    + urllib.parse.urlencode({"query": expr}), timeout=10) as resp:
            answer = json.loads(resp.read())
    except urllib.error.HTTPError as exc:  # 400: the query does not parse or type-check
        raise AssertionError(f"Prometheus refused {expr}: {exc.read().decode()}") from None
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def dashboard_queries(model: str) -> list[tuple[str, str]]:
    """Each panel query as Grafana would send it with ``model`` and all workers selected."""
    out = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets") or []:
                expr = (target["expr"].replace("$__rate_interval", "1m")
                        .replace("$model", model).replace("$worker", ".*"))
                out.append((panel["title"], expr))
    return out


@contextmanager
def synthetic_traffic(model: str):
    """Gateway, queue and worker metrics moving as a busy tokq's would, from this process."""
    gateway = metrics.GatewayMetrics(model)
    worker = metrics.WorkerMetrics(model, "w0", model_config={
        "model_type": "bert", "hidden_size": 384, "num_hidden_layers": 6,
        "num_attention_heads": 12, "intermediate_size": 1536}, peak_flops=1e12,
        device="cpu", dtype="float32")
    stop = threading.Event()

    class Stats:
        queued_entries, queued_tokens, oldest_age_ms = 52, 7000, 5000
        inflight_items, inflight_batches = 4, 1
        counters = {"enqueued": 0, "acked": 0, "requeued": 0}
        num_shards, unreadable_shards = 1, ()
        lanes = {"light": (10, 600), "heavy": (2, 2400), "batch": (40, 4000)}
        oldest_age_ms_by_class = {"interactive": 800, "batch": 5000}

    def run():
        n = 0
        while not stop.wait(0.05):
            n += 1
            gateway.request_started("Embed")
            gateway.embed_tokenized(1.0, 120)
            worker.observe_claim(0.001)
            worker.observe_claim_stop("full" if n % 3 else "heavy_item")
            # every other batch replayed from a CUDA graph (workers/cuda_graphs.py)
            worker.observe_batch([100, 120, 200], token_budget=512, forward_s=0.02, graphed=n % 2 == 0)
            if n % 4 == 0:  # a light batch run inside a heavy forward now and then
                worker.observe_preemption()
            worker.heartbeat()
            gateway.embed_done(15.0, 20.0)
            gateway.request_finished("Embed", "OK" if n % 10 else "INTERNAL", 0.04)
            Stats.counters = {"enqueued": 3 * n, "acked": 3 * n, "requeued": n // 20}
            metrics.observe_queue_stats(Stats, model=model)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        worker.close()


def test_prometheus_scrapes_tokq_metrics_and_runs_rules_and_dashboards(tmp_path):
    model = "scrape-test"
    server = metrics.start_metrics_server(0, addr="127.0.0.1")
    target = f"127.0.0.1:{server.server_port}"
    # One page holds every metric here: scraped once, as in a deployment each series comes
    # from one process (sum() in the rules would count a page scraped twice twice).
    config = loopback_config({"tokq-gateway": [target], "tokq-worker": []}, tmp_path)
    try:
        with synthetic_traffic(model), prometheus(config, tmp_path) as url:
            mfu = _wait_until(lambda: query(url, "model_worker:tokq_worker_mfu:ratio_rate1m"
                                                 f'{{model="{model}"}}'), 60)
            assert 0 < float(mfu[0]["value"][1]) < 1
            # Each rule waited for: their groups are evaluated at their own moments, and on a
            # loaded machine one can lag the MFU rule's (CI once found this one still empty).
            depth = _wait_until(lambda: query(
                url, f'model:tokq_queue_queued_tokens:sum{{model="{model}"}}'), 60)
            assert float(depth[0]["value"][1]) == 7000
            batch_age = _wait_until(lambda: query(
                url, f'model_priority:tokq_queue_oldest_age_seconds:max{{model="{model}",priority="batch"}}'), 60)
            assert float(batch_age[0]["value"][1]) == 5
            errors = _wait_until(lambda: query(
                url, f'model:tokq_gateway_request_errors:ratio_rate5m{{model="{model}"}}'), 60)
            assert 0.05 < float(errors[0]["value"][1]) < 0.2  # one request in ten fails
            for title, expr in dashboard_queries(model):
                query(url, expr)  # every panel query runs on a real Prometheus
            empty = [title for title, expr in dashboard_queries(model) if not query(url, expr)]
            # Only panels about events this traffic never makes may be empty.
            assert set(empty) <= {"Worker errors", "Requeues and expirations", "Rerank latency"}, empty
    finally:
        server.shutdown()


@pytest.mark.slow
def test_prometheus_scrapes_a_running_tokq_up(tmp_path, bundled_model_dir):
    """The key series reach Prometheus from the real gateway and worker processes."""
    grpc_port, metrics_port = free_port(), free_port_block(2)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    up = subprocess.Popen(
        [sys.executable, "-m", "tokq.cli", "up", "--port", str(grpc_port), "--metrics-port",
         str(metrics_port), "--workers", "1", "--device", "cpu", "--http-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(up.stdout), daemon=True)
    reader.start()
    try:
        _wait_until(lambda: up.poll() is not None or any("metrics:" in ln for ln in lines), 180)
        assert up.poll() is None, "".join(lines)
        said = next(ln for ln in lines if "metrics:" in ln)
        assert f":{metrics_port}/metrics" in said and f":{metrics_port + 1}" in said
        config = loopback_config({"tokq-gateway": [f"127.0.0.1:{metrics_port}"],
                                  "tokq-worker": [f"127.0.0.1:{metrics_port + 1}"]}, tmp_path)
        from tokq import Client

        with prometheus(config, tmp_path) as url, Client(f"127.0.0.1:{grpc_port}") as client:
            for i in range(5):
                assert len(client.embed([f"text {i}", "another input"])) == 2
            for expr in ('tokq_gateway_requests_total{job="tokq-gateway",rpc="Embed",code="OK"}',
                         'tokq_worker_batches_total{job="tokq-worker"}',
                         'tokq_worker_forward_tokens_total{job="tokq-worker"}',
                         "tokq_worker_heartbeat_timestamp_seconds",
                         "tokq_queue_enqueued_total", "tokq_queue_queued_tokens"):
                found = _wait_until(lambda: query(url, expr), 60)
                assert found, expr
            ok = query(url, 'sum(tokq_gateway_requests_total{rpc="Embed",code="OK"})')
            assert float(ok[0]["value"][1]) == 5
    finally:
        stop_all([up], timeout_s=30)
