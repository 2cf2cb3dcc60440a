"""Every Prometheus metric tokq exports: names, help texts and bucket layouts, in one place.

Names are ``tokq_<stage>_<what>_<unit>``; times are seconds (Prometheus' base unit), sizes
are tokens or items. Labels: ``model`` on everything, ``worker`` on worker metrics, ``rpc``
and ``code`` (gRPC status name) on requests, ``priority`` (the call's class: interactive, batch;
"" where none applies or it was refused before its class was read). Importable without torch.

Gateway (``GatewayMetrics`` is the gateway's observer; see gateway/embedding.py)
  tokq_gateway_requests_total{rpc,code,priority}  counter   finished RPCs (model="": refused before
      naming a served model; rpc "Embed" or "Rerank" on gRPC, "http.Embeddings" or "http.Rerank"
      on HTTP)
  tokq_gateway_request_duration_seconds{rpc,priority}  histogram whole RPC, as the gateway saw it
  tokq_gateway_tokenize_duration_seconds          histogram tokenizing one Embed request
  tokq_gateway_queue_duration_seconds{priority}   histogram queue wait of a request (its slowest item)
  tokq_gateway_inference_duration_seconds         histogram forward time of a request (its slowest item)
  tokq_gateway_request_input_tokens               histogram tokens in one Embed request
  tokq_gateway_enqueue_batch_requests             histogram enqueues sent to Redis in one round trip
      (tokq.redis.pipeline: under load concurrent calls' enqueues share one; _count is round trips)
  tokq_gateway_inflight_requests                  gauge     RPCs being served now
  tokq_gateway_model_info{task}                   gauge     always 1; the model's task (embed, rerank),
      for joining on model. A Rerank request's tokenize, queue and inference figures are in the
      histograms above, one request each; its tokens are every pair's

Queue (``observe_queue_stats``; exported by one gateway process per model, elected by a Redis
lock (gateway/server.py), so each series exists once and sum() over processes adds up)
  tokq_queue_queued_entries / tokq_queue_queued_tokens       gauge   waiting to be claimed
  tokq_queue_oldest_age_seconds                              gauge   age of the head entry
  tokq_queue_priority_oldest_age_seconds{priority}           gauge   the same per priority class
      (interactive, batch: tokq/queue/priority.py)
  tokq_queue_lane_queued_entries{lane} / tokq_queue_lane_queued_tokens{lane}   gauge   the same
      per lane (light, heavy: interactive work; batch: batch-class work; tokq/queue/claim_rule.py);
      the batch lane's tokens are exact; of the interactive lanes', the shorter one's are exact
      while it holds at most 1,000 entries, else scaled from its first 1,000 (lua/stats.lua)
  tokq_queue_inflight_items / tokq_queue_inflight_batches    gauge   claimed, not yet acked
  tokq_queue_unreadable_shards_ratio                         gauge   share of the queue's shards
      whose stats the last reading could not get (their node unreachable; the exporter logs
      which): the gauges above then sum the other shards only, and the totals below keep
      those shards' last reading. 0 while every shard answers
  tokq_queue_{enqueued,rejected,rejected_batch,cancelled,claimed,expired,orphaned,requeued,failed,acked}_total   counter
      rejected counts both classes' refused items; rejected_batch the batch class's of them
      The totals live in a Redis hash shared by every process, so a Counter's inc() cannot
      express them; a custom collector reports the last value read as a true counter (TYPE
      counter), which keeps rate() and increase() correct and treats a Redis restart as a reset.

Worker (``WorkerMetrics``). The batch and forward metrics describe what a batch's forward ran,
not what was claimed: an item refused before the forward (a token id past the vocabulary, too
long) or given up by a failed forward is in none of them (it is an errors_total{kind="item"});
a batch none of whose items was forwarded is no forward pass at all.
  tokq_worker_batches_total                       counter   forward passes
  tokq_worker_batch_tokens                        histogram tokens forwarded per batch (16..65536, x2)
  tokq_worker_batch_items                         histogram sequences forwarded per batch
  tokq_worker_batch_fill_ratio                    histogram batch tokens forwarded / token budget, of
      batches claimed up to the budget only: a light batch claimed to pre-empt a heavy forward
      holds what landed meanwhile (often one query) however busy the worker, so it is left out
  tokq_worker_forward_duration_seconds            histogram forward pass (its tokens: batch_tokens
      and forward_tokens_total; no size-class label, which would multiply every worker's series).
      A heavy forward's leaves out the light batches nested in it (timed on their own): the
      seconds add up to the device's, not more
  tokq_worker_claim_duration_seconds              histogram one claim-script call
  tokq_worker_claim_stops_total{reason}           counter   claims by why their batch stopped growing
      (tokq.queue.claim_rule.STOP_REASONS): full, heavy_item, batch_item, lookahead, dry, isolated,
      dropped, preempt (a light-only claim), heavy_only, and backlog (a light-only claim refused,
      no batch)
  tokq_worker_forward_tokens_total                counter   tokens forwarded
  tokq_worker_forward_flops_total                 counter   model FLOPs forwarded (tokq.model.flops)
  tokq_worker_budget_tokens                       gauge     token budget in force
  tokq_worker_throughput_tokens_per_second        gauge     tokens/s over the last window_s
  tokq_worker_device_peak_flops_per_second        gauge     dense 16-bit peak of the device
  tokq_worker_mfu_ratio                           gauge     FLOP/s over the last window_s / peak
  tokq_worker_heartbeat_timestamp_seconds         gauge     unix time of the last heartbeat
  tokq_worker_errors_total{kind}                  counter   item: one per item answered with an error;
      redis: a failed Redis call; device: a device error; hung: a forward past
      --hung-forward-ms. device and hung are counted (and logged) but seldom scraped: the
      worker exits at once after them. Restarts are alerted on from process_start_time_seconds
      (TokqWorkerRestarted)
  tokq_worker_nonfinite_vectors_total             counter   NaN/inf vectors refused (INTERNAL)
  tokq_worker_preemptions_total                   counter   light batches run nested in a heavy
      forward (mostly heavy-lane or batch-class work: workers/preempt.py; each is also one of
      batches_total), counted as it ends; one
      offered too late, run right after it, is not
  tokq_worker_graphed_batches_total               counter   forward passes replayed from a CUDA graph
      (workers/cuda_graphs.py; each is also one of batches_total)
  tokq_worker_device_info{device,dtype}           gauge     always 1; carries the labels
The gauges over a window show a worker's state on its own /metrics page; dashboards and rules
use rate() of the counters instead, which does not depend on when a scrape lands.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping

from prometheus_client import (REGISTRY, Counter, Gauge, Histogram, disable_created_metrics,
                               start_http_server)
from prometheus_client.core import CounterMetricFamily

from tokq.model.flops import forward_flops
from tokq.queue.priority import PRIORITIES

# No *_created series: they would double every counter and histogram for no use in tokq's
# dashboards (rate() does not need them).
disable_created_metrics()

# 0.5 ms .. 30 s in 1-2.5-5 steps: a claim takes ~1 ms, a request at most its deadline.
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0, 10.0, 30.0)
BATCH_TOKENS_BUCKETS = tuple(16 * 2**k for k in range(13))  # 16 .. 65536
BATCH_ITEMS_BUCKETS = tuple(2**k for k in range(11))  # 1 .. 1024
REQUEST_TOKENS_BUCKETS = tuple(8 * 2**k for k in range(16))  # 8 .. 262144 (512 inputs x 512)
FILL_RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)

# gRPC codes that count as the service failing (not the caller's mistake): alerts use this set.
ERROR_CODES = ("UNKNOWN", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "INTERNAL", "UNAVAILABLE",
               "DATA_LOSS")
QUEUE_COUNTERS = ("enqueued", "rejected", "rejected_batch", "cancelled", "claimed", "expired", "orphaned",
                  "requeued", "failed", "acked")
_QUEUE_COUNTER_HELP = {
    "enqueued": "Items accepted into the queue",
    "rejected": "Items refused because their priority class was at its token cap",
    "rejected_batch": "Batch-class items refused because the batch class was at its token cap "
                      "(also counted in rejected)",
    "claimed": "Items handed to a worker in a batch",
    "cancelled": "Requests cancelled by the gateway (the caller cancelled or timed out)",
    "expired": "Items dropped because their deadline passed before they ran",
    "orphaned": "Queued items dropped because their request was cancelled or timed out",
    "requeued": "Items put back after a worker's lease ran out",
    # Every answer is one of acked or failed, whoever wrote it: a worker's error result (an
    # invalid input, a failed forward, a non-finite vector), an item a worker's ack left out,
    # an item that failed max_attempts times. Only the first answer of an item counts (a
    # repeated or late ack counts nothing). Deadline drops are expired, not failed.
    "failed": "Items answered with an error (by a worker, or after max_attempts)",
    "acked": "Items answered with an embedding",
}

_M, _W = ("model",), ("model", "worker")

GATEWAY_REQUESTS = Counter("tokq_gateway_requests", "Finished RPCs by status code and priority class",
                           _M + ("rpc", "code", "priority"))
GATEWAY_REQUEST_DURATION = Histogram("tokq_gateway_request_duration_seconds",
                                     "Whole RPC as the gateway saw it", _M + ("rpc", "priority"),
                                     buckets=LATENCY_BUCKETS_S)
GATEWAY_TOKENIZE_DURATION = Histogram("tokq_gateway_tokenize_duration_seconds",
                                      "Tokenizing one Embed request", _M, buckets=LATENCY_BUCKETS_S)
GATEWAY_QUEUE_DURATION = Histogram("tokq_gateway_queue_duration_seconds",
                                   "Queue wait of an Embed request (its slowest item)", _M + ("priority",),
                                   buckets=LATENCY_BUCKETS_S)
GATEWAY_INFERENCE_DURATION = Histogram("tokq_gateway_inference_duration_seconds",
                                       "Forward time of an Embed request (its slowest item)", _M,
                                       buckets=LATENCY_BUCKETS_S)
GATEWAY_INPUT_TOKENS = Histogram("tokq_gateway_request_input_tokens",
                                 "Tokens in one Embed request, all inputs together", _M,
                                 buckets=REQUEST_TOKENS_BUCKETS)
GATEWAY_INFLIGHT = Gauge("tokq_gateway_inflight_requests", "RPCs being served now", _M)
GATEWAY_MODEL_INFO = Gauge("tokq_gateway_model_info", "Always 1; the task label says what the model does",
                           (*_M, "task"))
GATEWAY_ENQUEUE_BATCH = Histogram("tokq_gateway_enqueue_batch_requests",
                                  "Enqueues sent to Redis in one round trip", _M,
                                  buckets=tuple(2**k for k in range(11)))  # 1 .. 1024

QUEUE_ENTRIES = Gauge("tokq_queue_queued_entries", "Entries waiting to be claimed", _M)
QUEUE_TOKENS = Gauge("tokq_queue_queued_tokens", "Tokens waiting to be claimed", _M)
QUEUE_OLDEST_AGE = Gauge("tokq_queue_oldest_age_seconds", "Age of the oldest waiting entry", _M)
QUEUE_INFLIGHT_ITEMS = Gauge("tokq_queue_inflight_items", "Claimed items not yet answered", _M)
QUEUE_INFLIGHT_BATCHES = Gauge("tokq_queue_inflight_batches", "Batches under a live lease", _M)
QUEUE_LANE_ENTRIES = Gauge("tokq_queue_lane_queued_entries", "Entries waiting to be claimed, per lane",
                           _M + ("lane",))
QUEUE_LANE_TOKENS = Gauge("tokq_queue_lane_queued_tokens", "Tokens waiting to be claimed, per lane "
                          "(scaled from the shorter lane's first 1,000 entries past that)",
                          _M + ("lane",))
QUEUE_LANES = ("light", "heavy", "batch")
QUEUE_PRIORITY_OLDEST_AGE = Gauge("tokq_queue_priority_oldest_age_seconds",
                                  "Age of the oldest waiting entry of each priority class",
                                  _M + ("priority",))
QUEUE_PRIORITIES = PRIORITIES
QUEUE_UNREADABLE_SHARDS = Gauge("tokq_queue_unreadable_shards_ratio",
                                "Share of the queue's shards the last stats reading could not read "
                                "(left out of the other queue gauges)", _M)

WORKER_BATCHES = Counter("tokq_worker_batches", "Forward passes run", _W)
WORKER_BATCH_TOKENS = Histogram("tokq_worker_batch_tokens", "Tokens forwarded per batch", _W,
                                buckets=BATCH_TOKENS_BUCKETS)
WORKER_BATCH_ITEMS = Histogram("tokq_worker_batch_items", "Sequences forwarded per batch", _W,
                               buckets=BATCH_ITEMS_BUCKETS)
WORKER_FILL_RATIO = Histogram("tokq_worker_batch_fill_ratio", "Batch tokens forwarded / token budget",
                              _W, buckets=FILL_RATIO_BUCKETS)
WORKER_FORWARD_DURATION = Histogram("tokq_worker_forward_duration_seconds", "One forward pass",
                                    _W, buckets=LATENCY_BUCKETS_S)
WORKER_CLAIM_DURATION = Histogram("tokq_worker_claim_duration_seconds",
                                  "One call of the claim script", _W, buckets=LATENCY_BUCKETS_S)
WORKER_CLAIM_STOPS = Counter("tokq_worker_claim_stops", "Claims by why their batch stopped growing "
                             "(tokq.queue.claim_rule.STOP_REASONS)", _W + ("reason",))
# Only items the forward ran (workers/runner.py BatchOutcome.seqlens): MFU is the device's work.
WORKER_TOKENS = Counter("tokq_worker_forward_tokens", "Tokens forwarded", _W)
WORKER_FLOPS = Counter("tokq_worker_forward_flops", "Model FLOPs forwarded", _W)
WORKER_BUDGET = Gauge("tokq_worker_budget_tokens", "Token budget in force", _W)
WORKER_THROUGHPUT = Gauge("tokq_worker_throughput_tokens_per_second",
                          "Tokens forwarded per second over the last window", _W)
WORKER_PEAK_FLOPS = Gauge("tokq_worker_device_peak_flops_per_second",
                          "Dense 16-bit peak FLOP/s of the worker's device", _W)
WORKER_MFU = Gauge("tokq_worker_mfu_ratio",
                   "Model FLOP/s over the last window / device peak FLOP/s", _W)
WORKER_HEARTBEAT = Gauge("tokq_worker_heartbeat_timestamp_seconds",
                         "Unix time of the worker's last heartbeat", _W)
WORKER_ERRORS = Counter("tokq_worker_errors", "Worker errors by kind: item (per item answered with an "
                        "error), redis, device, hung", _W + ("kind",))
WORKER_NONFINITE = Counter("tokq_worker_nonfinite_vectors",
                           "Vectors refused because they held NaN or inf (answered INTERNAL)", _W)
WORKER_PREEMPTIONS = Counter("tokq_worker_preemptions",
                             "Light batches run nested inside a heavy forward", _W)
WORKER_GRAPHED = Counter("tokq_worker_graphed_batches",
                         "Forward passes replayed from a CUDA graph (workers/cuda_graphs.py)", _W)
WORKER_INFO = Gauge("tokq_worker_device_info", "Always 1; labels describe the worker's device",
                    _W + ("device", "dtype"))


class _QueueCounterCollector:
    """Reports the Redis-kept queue totals last read by observe_queue_stats as counters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, dict[str, float]] = {}  # model -> counter name -> total

    def update(self, model: str, counters: Mapping[str, float]) -> None:
        with self._lock:
            self._totals[model] = {k: float(counters.get(k, 0)) for k in QUEUE_COUNTERS}

    def forget(self, model: str) -> None:
        with self._lock:
            self._totals.pop(model, None)

    def describe(self) -> Iterable[CounterMetricFamily]:
        return self._families({})

    def collect(self) -> Iterable[CounterMetricFamily]:
        with self._lock:
            totals = {m: dict(c) for m, c in self._totals.items()}
        return self._families(totals)

    @staticmethod
    def _families(totals: dict[str, dict[str, float]]) -> list[CounterMetricFamily]:
        families = []
        for name in QUEUE_COUNTERS:
            family = CounterMetricFamily(f"tokq_queue_{name}", _QUEUE_COUNTER_HELP[name],
                                         labels=_M)
            for model, counters in sorted(totals.items()):
                family.add_metric([model], counters[name])
            families.append(family)
        return families


QUEUE_COUNTER_COLLECTOR = _QueueCounterCollector()
REGISTRY.register(QUEUE_COUNTER_COLLECTOR)


def series_names() -> dict[str, str]:
    """Every tokq series name a scrape can show -> its metric type (histograms give their
    _bucket, _sum and _count series): what dashboards and rules may name."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "gauge": ("",)}
    names = {}
    for family in REGISTRY.collect():
        if family.name.startswith("tokq_"):
            for suffix in suffixes[family.type]:
                names[family.name + suffix] = family.type
    return names


def start_metrics_server(port: int, addr: str = "0.0.0.0"):
    """Serve /metrics on ``addr:port`` from a daemon thread; returns the server
    (``.server_port`` is the bound port, useful with port 0; ``.shutdown()`` stops it)."""
    server, _thread = start_http_server(port, addr=addr)
    return server


def forget_queue_stats(model: str) -> None:
    """Stop exporting ``model``'s queue metrics (this process is not its exporter)."""
    for gauge in (QUEUE_ENTRIES, QUEUE_TOKENS, QUEUE_OLDEST_AGE, QUEUE_INFLIGHT_ITEMS,
                  QUEUE_INFLIGHT_BATCHES, QUEUE_UNREADABLE_SHARDS):
        gauge.remove(model)  # a no-op for a series never created
    for lane in QUEUE_LANES:
        QUEUE_LANE_ENTRIES.remove(model, lane)
        QUEUE_LANE_TOKENS.remove(model, lane)
    for priority in QUEUE_PRIORITIES:
        QUEUE_PRIORITY_OLDEST_AGE.remove(model, priority)
    QUEUE_COUNTER_COLLECTOR.forget(model)


def observe_queue_stats(stats, *, model: str) -> None:
    """Export one queue-stats reading (a tokq.queue.shard.QueueStats or anything with its fields)."""
    QUEUE_ENTRIES.labels(model).set(stats.queued_entries)
    QUEUE_TOKENS.labels(model).set(stats.queued_tokens)
    QUEUE_OLDEST_AGE.labels(model).set(stats.oldest_age_ms / 1000.0)
    QUEUE_INFLIGHT_ITEMS.labels(model).set(stats.inflight_items)
    QUEUE_INFLIGHT_BATCHES.labels(model).set(stats.inflight_batches)
    lanes = getattr(stats, "lanes", None)  # {lane: (entries, tokens)}
    for lane, (entries, tokens) in (lanes or {}).items():
        QUEUE_LANE_ENTRIES.labels(model, lane).set(entries)
        QUEUE_LANE_TOKENS.labels(model, lane).set(tokens)
    for priority, age_ms in (getattr(stats, "oldest_age_ms_by_class", None) or {}).items():
        QUEUE_PRIORITY_OLDEST_AGE.labels(model, priority).set(age_ms / 1000.0)
    QUEUE_UNREADABLE_SHARDS.labels(model).set(len(stats.unreadable_shards) / max(1, stats.num_shards))
    QUEUE_COUNTER_COLLECTOR.update(model, stats.counters)


class RequestCounts:
    """Finished calls of one model label: counted by status code and timed. The model label is
    "" for calls refused before they named a served model (unknown model, unparsable body,
    unauthenticated): those are counted too, never under a name a caller chose."""

    def __init__(self, model: str) -> None:
        self.model = model
        # Each call's children looked up once, not per call (``labels`` locks and hashes).
        self._requests: dict[tuple[str, str, str], object] = {}
        self._durations: dict[tuple[str, str], object] = {}

    def count(self, rpc: str, code: str, duration_s: float, priority: str = "") -> None:
        """``code`` is the gRPC status name ("OK", "INVALID_ARGUMENT", ...); ``priority`` the
        call's class, "" where none applies."""
        requests = self._requests.get((rpc, code, priority))
        if requests is None:
            requests = self._requests[rpc, code, priority] = GATEWAY_REQUESTS.labels(
                self.model, rpc, code, priority)
        requests.inc()
        duration = self._durations.get((rpc, priority))
        if duration is None:
            duration = self._durations[rpc, priority] = GATEWAY_REQUEST_DURATION.labels(
                self.model, rpc, priority)
        duration.observe(duration_s)


class GatewayMetrics(RequestCounts):
    """The gateway's observer: gateway/embedding.py calls these hooks (``enqueues_sent``: the
    queue's pipeliner, wired in gateway/server.py)."""

    def __init__(self, model: str, task: str = "embed") -> None:
        super().__init__(model)
        GATEWAY_MODEL_INFO.labels(model, task).set(1)
        self._inflight = GATEWAY_INFLIGHT.labels(model)
        self._inflight.set(0)
        self._tokenize = GATEWAY_TOKENIZE_DURATION.labels(model)
        self._input_tokens = GATEWAY_INPUT_TOKENS.labels(model)
        self._queue: dict[str, object] = {}  # priority -> its child
        self._inference = GATEWAY_INFERENCE_DURATION.labels(model)
        self._enqueue_batch = GATEWAY_ENQUEUE_BATCH.labels(model)

    def request_started(self, rpc: str) -> None:
        self._inflight.inc()

    def request_finished(self, rpc: str, code: str, duration_s: float, priority: str = "") -> None:
        self._inflight.dec()
        self.count(rpc, code, duration_s, priority)

    def embed_tokenized(self, tokenize_ms: float, num_tokens: int) -> None:
        self._tokenize.observe(tokenize_ms / 1000.0)
        self._input_tokens.observe(num_tokens)

    def embed_done(self, queue_ms: float, inference_ms: float, priority: str = "") -> None:
        queue = self._queue.get(priority)
        if queue is None:
            queue = self._queue[priority] = GATEWAY_QUEUE_DURATION.labels(self.model, priority)
        queue.observe(queue_ms / 1000.0)
        self._inference.observe(inference_ms / 1000.0)

    def enqueues_sent(self, num_requests: int) -> None:
        """One Redis round trip carried ``num_requests`` enqueues (tokq.redis.pipeline)."""
        self._enqueue_batch.observe(num_requests)


class WorkerMetrics:
    """One worker's metrics. ``model_config`` is the model's config.json dict (for FLOPs);
    ``peak_flops`` the device peak (tokq.model.flops.device_peak_flops), None when unknown: no MFU then."""

    def __init__(self, model: str, worker: str, *, model_config: Mapping | None = None,
                 peak_flops: float | None = None, device: str = "", dtype: str = "",
                 window_s: float = 10.0, clock=time.monotonic) -> None:
        self.labels = (model, worker)
        self.model_config = model_config
        self.peak_flops = peak_flops
        self.window_s = window_s
        self._clock = clock
        self._started = clock()
        self._recent: deque[tuple[float, int, float]] = deque()  # (t, tokens, flops)
        self._lock = threading.Lock()
        WORKER_INFO.labels(*self.labels, device, dtype).set(1)
        WORKER_THROUGHPUT.labels(*self.labels).set_function(lambda: self._window_rates()[0])
        if peak_flops:
            WORKER_PEAK_FLOPS.labels(*self.labels).set(peak_flops)
            WORKER_MFU.labels(*self.labels).set_function(lambda: self._window_rates()[1] / peak_flops)
        self._info_labels = (device, dtype)
        self._error_kinds: set[str] = set()
        self._stops: dict[str, object] = {}  # reason -> its child counter

    def observe_claim(self, duration_s: float) -> None:
        WORKER_CLAIM_DURATION.labels(*self.labels).observe(duration_s)

    def observe_claim_stop(self, reason: str) -> None:
        """A claim's batch stopped growing for ``reason`` (tokq.queue.claim_rule.STOP_REASONS)."""
        child = self._stops.get(reason)
        if child is None:
            child = self._stops[reason] = WORKER_CLAIM_STOPS.labels(*self.labels, reason)
        child.inc()

    def set_budget(self, token_budget: int) -> None:
        WORKER_BUDGET.labels(*self.labels).set(token_budget)

    def observe_batch(self, seqlens, *, token_budget: int, forward_s: float, graphed: bool = False,
                      claimed_tokens: int | None = None) -> None:
        """One forward pass over sequences of these lengths (np.diff(batch.cu_seqlens)): the
        items it ran, not those refused before it (BatchOutcome.seqlens); ``graphed``: replayed
        from a CUDA graph. ``token_budget``: the budget it was claimed up to; 0 for a
        pre-empting claim, left out of the fill ratio. ``claimed_tokens``: the fill's tokens
        where one claim ran as two forwards (its interactive part first), else this forward's."""
        if graphed:
            WORKER_GRAPHED.labels(*self.labels).inc()
        lens = [int(n) for n in seqlens]
        num_tokens = sum(lens)
        flops = forward_flops(self.model_config, lens) if self.model_config else 0
        WORKER_BATCHES.labels(*self.labels).inc()
        WORKER_BATCH_TOKENS.labels(*self.labels).observe(num_tokens)
        WORKER_BATCH_ITEMS.labels(*self.labels).observe(len(lens))
        if token_budget > 0:
            self.set_budget(token_budget)
            filled = num_tokens if claimed_tokens is None else claimed_tokens
            WORKER_FILL_RATIO.labels(*self.labels).observe(min(1.0, filled / token_budget))
        WORKER_FORWARD_DURATION.labels(*self.labels).observe(forward_s)
        WORKER_TOKENS.labels(*self.labels).inc(num_tokens)
        WORKER_FLOPS.labels(*self.labels).inc(flops)
        with self._lock:
            self._recent.append((self._clock(), num_tokens, flops))

    def observe_error(self, kind: str) -> None:
        self._error_kinds.add(kind)
        WORKER_ERRORS.labels(*self.labels, kind).inc()

    def observe_nonfinite(self, num_vectors: int) -> None:
        WORKER_NONFINITE.labels(*self.labels).inc(num_vectors)

    def observe_preemption(self, num_batches: int = 1) -> None:
        """``num_batches`` light batches ran nested in a heavy forward."""
        WORKER_PREEMPTIONS.labels(*self.labels).inc(num_batches)

    def heartbeat(self) -> None:
        WORKER_HEARTBEAT.labels(*self.labels).set_to_current_time()

    def _window_rates(self) -> tuple[float, float]:
        """(tokens/s, FLOP/s) over the last window_s, or since start when younger than that."""
        now = self._clock()
        with self._lock:
            while self._recent and self._recent[0][0] < now - self.window_s:
                self._recent.popleft()
            tokens = sum(t for _, t, _ in self._recent)
            flops = sum(f for _, _, f in self._recent)
        span_s = max(1e-3, min(self.window_s, now - self._started))
        return tokens / span_s, flops / span_s

    def close(self) -> None:
        """Drop this worker's series (a worker stopped inside a process that goes on)."""
        for metric in (WORKER_BATCHES, WORKER_BATCH_TOKENS, WORKER_BATCH_ITEMS, WORKER_FILL_RATIO,
                       WORKER_FORWARD_DURATION, WORKER_CLAIM_DURATION, WORKER_TOKENS, WORKER_FLOPS, WORKER_BUDGET,
                       WORKER_THROUGHPUT, WORKER_PEAK_FLOPS, WORKER_MFU, WORKER_HEARTBEAT,
                       WORKER_NONFINITE, WORKER_PREEMPTIONS, WORKER_GRAPHED):
            metric.remove(*self.labels)  # a no-op for a series never created
        WORKER_INFO.remove(*self.labels, *self._info_labels)
        for kind in self._error_kinds:
            WORKER_ERRORS.remove(*self.labels, kind)
        for reason in list(self._stops):
            WORKER_CLAIM_STOPS.remove(*self.labels, reason)
        self._stops.clear()
