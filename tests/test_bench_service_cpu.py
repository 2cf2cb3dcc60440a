"""`tokq bench service` counts CPU per process: each step says how many cores tokq's gateway,
worker, Redis and the load generator used (which one saturates first), read from /proc for a
real `tokq up` with two gateway processes."""

from __future__ import annotations

import asyncio
import os

import pytest

from tokq.profiling.bench import loadgen
from tokq.profiling.bench.proc_cpu import cores_between, cpu_by_role, descendants, proc_cpu_s

pytestmark = pytest.mark.slow


def test_cpu_of_a_busy_child_is_counted_and_a_gone_one_is_not():
    import subprocess
    import sys
    import time

    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time() + 1.5\nwhile time.time() < t: pass"])
    try:
        assert child.pid in descendants(os.getpid())
        time.sleep(1.0)
        assert cpu_by_role({"busy": [child.pid]})["busy"][child.pid] >= 0.2  # spinning, even on a busy machine
    finally:
        child.wait(timeout=30)
    assert cpu_by_role({"busy": [child.pid]}) == {"busy": {}}  # reaped: nothing to read, not an error
    assert proc_cpu_s(os.getpid()) > 0
    # per role, over its processes: one that appeared in between counts from zero
    before, after = {"a": {1: 1.0}}, {"a": {1: 2.5, 2: 0.75}}
    assert cores_between(before, after, 3.0) == {"a": 0.75} and cores_between({}, after, 0) == {}


@pytest.mark.parametrize("generator_procs", [1, 2])
def test_each_step_says_the_cores_of_tokqs_gateway_worker_redis_and_load_generator(monkeypatch, generator_procs):
    """With ``generator_procs`` > 1 the load comes from that many processes (GeneratorProcs),
    whose CPU is the load generator's too."""
    from tokq.profiling.bench.service.cli import system_specs
    from tokq.profiling.bench.service.run import BenchOptions, measure
    from tokq.profiling.bench.service.systems import start_system
    import dataclasses

    monkeypatch.setenv("TOKQ_LATENCY_GOAL_MS", "0")  # the device default, not a fit to this moment's speed
    (spec,) = system_specs(["tokq-defaults"], budgets=[1024], profiled_budget=None, padded_max_batch=32,
                           padded_max_wait_ms=10.0)
    system = start_system(dataclasses.replace(spec, gateway_procs=2), threads=1)
    try:
        roles = system.process_roles()
        assert len(roles["worker"]) == 1 and len(roles["redis"]) == 1
        assert len(roles["gateway"]) >= 3  # the parent and its two processes (and the resource tracker)
        queries = loadgen.load_queries(None, 200, 5)[0]  # generated, with texts
        options = BenchOptions(rate=20.0, step_duration_s=2.0, timeout_s=10.0, slo_ms=5000.0,
                               generator_procs=generator_procs)
        result = asyncio.run(measure(system, queries, options))
        embeds = [_embed_calls(system.metrics_port + j) for j in range(2)]
    finally:
        system.close()
    (step,) = result["steps"]
    cores = step["cpu_cores"]
    assert set(cores) == {"gateway", "worker", "redis", "load generator"}
    # 40 calls in 2 s: the Python parts worked (Redis's few ms may round to 0 ticks), none used
    # more than the machine has
    assert all(0 <= c <= (os.cpu_count() or 1) for c in cores.values()), cores
    assert min(cores["gateway"], cores["worker"], cores["load generator"]) > 0, cores
    # the worker's metrics were read past the two gateways' ports: the batch figures are there
    assert step["batches"]["num_batches"] > 0 and step["batches"]["tokens_per_batch"] > 0
    # the load generator's calls reached both gateway processes (one connection would reach one)
    assert all(n > 0 for n in embeds) and sum(embeds) >= step["num_ok"], embeds


def _embed_calls(metrics_port: int) -> float:
    """Embed calls one gateway process answered, from its own metrics page."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "tokq_gateway_requests_total" and s.labels.get("rpc") == "Embed")
