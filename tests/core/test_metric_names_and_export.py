"""tokq.metrics: names follow the convention, helpers export what they are given, and
/metrics serves it all over HTTP."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request
import uuid
from dataclasses import dataclass, field

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from tokq import metrics
from tokq.model.flops import forward_flops

NAME_RULE = re.compile(r"^tokq_(gateway|queue|worker)_[a-z][a-z0-9_]*_"
                       r"(seconds|tokens|entries|items|batches|requests|ratio|total|info|per_second)$")


def _model() -> str:
    """A fresh model label, so tests sharing the process-wide registry never see each other."""
    return f"m-{uuid.uuid4().hex[:8]}"


def _value(name: str, **labels) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


@dataclass
class FakeStats:  # the fields of tokq.queue.shard.QueueStats
    queued_entries: int = 0
    queued_tokens: int = 0
    oldest_age_ms: int = 0
    inflight_items: int = 0
    inflight_batches: int = 0
    counters: dict = field(default_factory=dict)
    num_shards: int = 1
    unreadable_shards: tuple = ()


def test_every_metric_name_follows_the_convention():
    names = metrics.series_names()
    assert len(names) > 40
    for name, kind in names.items():
        base = re.sub(r"_(bucket|sum|count)$", "", name) if kind == "histogram" else name
        assert NAME_RULE.match(base), f"{name} breaks tokq_<stage>_<what>_<unit>"


def test_docstring_lists_every_metric():
    doc = metrics.__doc__
    for name, kind in metrics.series_names().items():
        if kind == "histogram" and not name.endswith("_bucket"):
            continue
        base = name.removesuffix("_bucket")
        listed = base in doc or (base.startswith("tokq_queue_") and base.endswith("_total"))
        assert listed, f"{base} is not in the module docstring"
    for counter in metrics.QUEUE_COUNTERS:
        assert counter in doc


def test_bucket_layouts_suit_their_values():
    lat = metrics.LATENCY_BUCKETS_S
    assert lat[0] == 0.0005 and lat[-1] == 30.0 and list(lat) == sorted(lat)
    tok = metrics.BATCH_TOKENS_BUCKETS
    assert tok[0] == 16 and tok[-1] == 65536
    assert all(b == 2 * a for a, b in zip(tok, tok[1:])), "batch tokens buckets are geometric x2"
    fill = metrics.FILL_RATIO_BUCKETS
    assert 0 < fill[0] and fill[-1] == 1.0 and list(fill) == sorted(fill)


def test_queue_stats_export_gauges_and_redis_totals_as_counters():
    model = _model()
    stats = FakeStats(queued_entries=7, queued_tokens=900, oldest_age_ms=2500, inflight_items=3,
                      inflight_batches=1, counters={"enqueued": 10, "requeued": 2, "expired": 1})
    metrics.observe_queue_stats(stats, model=model)
    assert _value("tokq_queue_queued_entries", model=model) == 7
    assert _value("tokq_queue_queued_tokens", model=model) == 900
    assert _value("tokq_queue_oldest_age_seconds", model=model) == 2.5
    assert _value("tokq_queue_inflight_items", model=model) == 3
    assert _value("tokq_queue_inflight_batches", model=model) == 1
    assert _value("tokq_queue_enqueued_total", model=model) == 10
    assert _value("tokq_queue_requeued_total", model=model) == 2
    assert _value("tokq_queue_rejected_total", model=model) == 0  # missing keys read as 0
    # A later reading replaces the totals (they are Redis' numbers, not increments).
    stats.counters = {"enqueued": 25, "requeued": 2, "expired": 4}
    metrics.observe_queue_stats(stats, model=model)
    assert _value("tokq_queue_enqueued_total", model=model) == 25
    assert _value("tokq_queue_expired_total", model=model) == 4
    assert _value("tokq_queue_unreadable_shards_ratio", model=model) == 0  # a one-shard reading


def test_queue_stats_say_what_share_of_the_shards_went_unread():
    # tokq.queue.stats.SummedStats with one of 4 shards' node down: the gauges sum the other 3
    # (tests/cluster/test_node_down_costs_its_own_shards.py), and the ratio says a quarter is
    # missing from them.
    model = _model()
    metrics.observe_queue_stats(FakeStats(queued_entries=5, num_shards=4, unreadable_shards=(2,)),
                                model=model)
    assert _value("tokq_queue_queued_entries", model=model) == 5
    assert _value("tokq_queue_unreadable_shards_ratio", model=model) == 0.25
    metrics.observe_queue_stats(FakeStats(queued_entries=6, num_shards=4), model=model)
    assert _value("tokq_queue_unreadable_shards_ratio", model=model) == 0
    metrics.forget_queue_stats(model)
    assert _value("tokq_queue_unreadable_shards_ratio", model=model) is None


def test_gateway_observer_counts_requests_by_rpc_and_code():
    model = _model()
    gw = metrics.GatewayMetrics(model)
    gw.request_started("Embed")
    gw.request_started("Embed")
    assert _value("tokq_gateway_inflight_requests", model=model) == 2
    gw.embed_tokenized(tokenize_ms=1.5, num_tokens=40)
    gw.embed_done(queue_ms=12.0, inference_ms=3.0)
    gw.request_finished("Embed", "OK", 0.02)
    gw.request_finished("Embed", "RESOURCE_EXHAUSTED", 0.001)
    assert _value("tokq_gateway_inflight_requests", model=model) == 0
    assert _value("tokq_gateway_requests_total", model=model, rpc="Embed", code="OK", priority="") == 1
    assert _value("tokq_gateway_requests_total", model=model, rpc="Embed",
                  code="RESOURCE_EXHAUSTED", priority="") == 1
    assert _value("tokq_gateway_request_duration_seconds_count", model=model, rpc="Embed", priority="") == 2
    assert _value("tokq_gateway_tokenize_duration_seconds_sum", model=model) == pytest.approx(0.0015)
    assert _value("tokq_gateway_queue_duration_seconds_sum", model=model, priority="") == pytest.approx(0.012)
    assert _value("tokq_gateway_inference_duration_seconds_sum", model=model) == pytest.approx(0.003)
    assert _value("tokq_gateway_request_input_tokens_sum", model=model) == 40
    # 12 ms lands in the 25 ms bucket, not the 10 ms one: the histogram is in seconds
    assert _value("tokq_gateway_queue_duration_seconds_bucket", model=model, priority="", le="0.01") == 0
    assert _value("tokq_gateway_queue_duration_seconds_bucket", model=model, priority="", le="0.025") == 1
    gw.enqueues_sent(1)
    gw.enqueues_sent(7)
    assert _value("tokq_gateway_enqueue_batch_requests_count", model=model) == 2  # round trips
    assert _value("tokq_gateway_enqueue_batch_requests_sum", model=model) == 8  # enqueues
    assert _value("tokq_gateway_enqueue_batch_requests_bucket", model=model, le="4.0") == 1


BERT_TINY = {"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "intermediate_size": 128}


def test_worker_batch_metrics_fill_ratio_and_close():
    model = _model()
    w = metrics.WorkerMetrics(model, "w0", model_config=BERT_TINY, device="cpu", dtype="float32")
    w.observe_claim(0.002)
    w.observe_batch([100, 200, 212], token_budget=1024, forward_s=0.05)
    w.observe_batch([30], token_budget=1024, forward_s=0.004, graphed=True)
    w.observe_error("forward")
    w.heartbeat()
    labels = {"model": model, "worker": "w0"}
    assert _value("tokq_worker_batches_total", **labels) == 2
    assert _value("tokq_worker_graphed_batches_total", **labels) == 1  # the CUDA graph replay
    assert _value("tokq_worker_forward_tokens_total", **labels) == 542
    assert _value("tokq_worker_batch_items_sum", **labels) == 4
    assert _value("tokq_worker_batch_fill_ratio_sum", **labels) == pytest.approx(542 / 1024)
    assert _value("tokq_worker_budget_tokens", **labels) == 1024
    assert _value("tokq_worker_forward_flops_total", **labels) == (
        forward_flops(BERT_TINY, [100, 200, 212]) + forward_flops(BERT_TINY, [30]))
    assert _value("tokq_worker_forward_duration_seconds_count", **labels) == 2  # one series a worker
    assert _value("tokq_worker_forward_duration_seconds_sum", **labels) == pytest.approx(0.054)
    assert _value("tokq_worker_claim_duration_seconds_count", **labels) == 1
    assert _value("tokq_worker_errors_total", kind="forward", **labels) == 1
    assert _value("tokq_worker_heartbeat_timestamp_seconds", **labels) > 1.6e9
    assert _value("tokq_worker_device_info", device="cpu", dtype="float32", **labels) == 1
    assert _value("tokq_worker_mfu_ratio", **labels) is None  # peak unknown: no MFU series
    w.close()
    exposed = "\n".join(f"{s.name}{s.labels}" for fam in REGISTRY.collect() for s in fam.samples)
    assert model not in exposed


def test_throughput_and_mfu_cover_the_last_window_only():
    now = [1000.0]
    model = _model()
    flops_512 = forward_flops(BERT_TINY, [512])
    w = metrics.WorkerMetrics(model, "w0", model_config=BERT_TINY, peak_flops=flops_512,
                              window_s=10.0, clock=lambda: now[0])
    labels = {"model": model, "worker": "w0"}
    now[0] += 20.0
    w.observe_batch([512], token_budget=512, forward_s=0.1)
    w.observe_batch([512], token_budget=512, forward_s=0.1)
    assert _value("tokq_worker_throughput_tokens_per_second", **labels) == pytest.approx(1024 / 10)
    assert _value("tokq_worker_mfu_ratio", **labels) == pytest.approx(2 / 10)
    assert _value("tokq_worker_device_peak_flops_per_second", **labels) == flops_512
    now[0] += 10.5  # both batches left the window: an idle worker reads 0, not its last rate
    assert _value("tokq_worker_throughput_tokens_per_second", **labels) == 0
    assert _value("tokq_worker_mfu_ratio", **labels) == 0
    w.close()


def test_metrics_server_serves_every_family_over_http():
    model = _model()
    metrics.observe_queue_stats(FakeStats(queued_tokens=5, counters={"acked": 3}), model=model)
    server = metrics.start_metrics_server(0, addr="127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics") as resp:
            text = resp.read().decode()
    finally:
        server.shutdown()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["tokq_queue_acked"].type == "counter"
    acked = [s for s in families["tokq_queue_acked"].samples if s.labels.get("model") == model]
    assert acked and acked[0].value == 3
    assert not [n for n in families if n.endswith("_created")]


def test_importing_metrics_does_not_import_torch():
    code = "import sys, tokq.metrics; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
