"""The open-loop load generator against a tiny real gRPC Embedder whose handler serves one
request at a time and sleeps a fixed time: a server of known capacity."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest

from tokq.profiling import workload
from tokq.profiling.bench import loadgen
from tokq.profiling.bench.service.systems import GrpcSender
from tokq.v1 import embedder_pb2 as pb
from tokq.v1 import embedder_pb2_grpc as pb_grpc


class SerialSleeper(pb_grpc.EmbedderServicer):
    """Answers each Embed after ``service_s``, one request at a time, in arrival order."""

    def __init__(self, service_s: float) -> None:
        self.service_s = service_s
        self._lock = asyncio.Lock()  # FIFO: waiters are woken in order

    async def Embed(self, request, context):
        async with self._lock:
            await asyncio.sleep(self.service_s)
        return pb.EmbedResponse(embeddings=[pb.Embedding(values=[1.0])], model="sleeper")


async def start_sleeper(service_s: float) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    pb_grpc.add_EmbedderServicer_to_server(SerialSleeper(service_s), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def arrivals_at(offsets_s: list[float]) -> list[loadgen.Arrival]:
    return [loadgen.Arrival(t, ("hello",), 3) for t in offsets_s]


async def test_latency_counts_from_intended_time_including_queueing():
    service_s = 0.2
    server, target = await start_sleeper(service_s)
    sender = GrpcSender(target, timeout_s=10)
    try:
        offsets = [0.0, 0.02, 0.04, 0.06, 0.08]
        samples = await loadgen.run_open_loop(sender, arrivals_at(offsets))
    finally:
        await sender.close()
        await server.stop(None)
    assert [s.status for s in samples] == ["OK"] * 5
    # Open loop: every request left before the first reply came back.
    assert max(s.sent_s for s in samples) < min(s.done_s for s in samples)
    # The server answers one per service_s, so the k-th reply cannot come before (k+1)*service_s;
    # each latency is counted from the intended time, so it carries that queueing delay.
    for k, done_s in enumerate(sorted(s.done_s for s in samples)):
        assert done_s >= (k + 1) * service_s - 1e-3
    last = max(samples, key=lambda s: s.done_s)
    assert last.latency_ms >= (5 * service_s - last.intended_s) * 1000 - 1
    summary = loadgen.summarize(samples, offered_rate_per_s=50)
    assert summary["latency_ms"]["max"] == pytest.approx(max(s.latency_ms for s in samples), abs=1e-3)
    assert summary["num_ok"] == 5 and summary["errors"] == {}


class PidSender:
    """Answers at once, its process id as the queue time: which process sent each request."""

    async def __call__(self, texts) -> loadgen.Reply:
        return loadgen.Reply("OK", queue_ms=float(os.getpid()))


async def test_generator_processes_send_every_arrival_at_its_time_and_share_them():
    offsets = [i * 0.01 for i in range(40)]
    procs = await asyncio.to_thread(loadgen.GeneratorProcs, PidSender, 2)
    try:
        first = await procs.run(arrivals_at(offsets))
        again = await procs.run(arrivals_at(offsets[:10]))  # the same processes serve the next run
        pids = set(procs.pids)
    finally:
        await asyncio.to_thread(procs.close)
    assert [s.intended_s for s in first] == offsets and [s.status for s in first] == ["OK"] * 40
    senders = {int(s.queue_ms) for s in first}
    assert senders == pids and len(pids) == 2 and os.getpid() not in pids
    assert [int(s.queue_ms) for s in first[:4]] == [first[0].queue_ms, first[1].queue_ms] * 2  # every other
    # one clock: each left at (not before) its time, and the run took about the schedule's span
    assert all(s.sent_s >= s.intended_s - 1e-3 for s in first)
    assert len(again) == 10 and {int(s.queue_ms) for s in again} == pids
    assert all(not p.is_alive() for p in procs._procs)


class BrokenSender:
    def __init__(self) -> None:
        raise OSError("no route to the target")


def test_a_generator_process_that_cannot_make_its_sender_says_why_and_none_is_left():
    import multiprocessing

    with pytest.raises(RuntimeError, match="could not make its sender: OSError: no route to the target"):
        loadgen.GeneratorProcs(BrokenSender, 2)
    assert not multiprocessing.active_children()  # the one that started was stopped


async def test_generator_processes_reach_a_grpc_server():
    server, target = await start_sleeper(0.001)
    procs = await asyncio.to_thread(loadgen.GeneratorProcs, functools.partial(GrpcSender, target, 10.0), 2)
    try:
        samples = await procs.run(arrivals_at([0.0, 0.01, 0.02, 0.03]))
    finally:
        await asyncio.to_thread(procs.close)
        await server.stop(None)
    assert [s.status for s in samples] == ["OK"] * 4


async def test_a_stalled_server_shows_as_deadline_errors_not_a_lower_rate():
    server, target = await start_sleeper(0.5)
    sender = GrpcSender(target, timeout_s=0.3)
    try:
        samples = await loadgen.run_open_loop(sender, arrivals_at([0.0, 0.01, 0.02]))
    finally:
        await sender.close()
        await server.stop(None)
    summary = loadgen.summarize(samples, offered_rate_per_s=100)
    assert summary["errors"] == {"DEADLINE_EXCEEDED": 3}
    assert summary["num_ok"] == 0 and summary["throughput_rps"] == 0
    assert summary["latency_ms"]["p50"] >= 300  # failed requests count, at their error time
    assert not loadgen.within_slo(summary, slo_ms=1000)


@pytest.mark.slow
async def test_step_search_stops_at_the_capacity_of_a_known_server():
    capacity_rps = 100.0  # 10 ms per request, one at a time
    server, target = await start_sleeper(1 / capacity_rps)
    sender = GrpcSender(target, timeout_s=5)
    queries = workload.generate(200, seed=3)
    queries = [workload.Query(q.id, q.num_tokens, q.t_s, "q") for q in queries]

    async def run_at(rate: float) -> dict:
        samples = await loadgen.run_open_loop(sender, loadgen.poisson_schedule(queries, rate, 1.0, seed=2))
        return loadgen.summarize(samples, rate)

    try:
        result = await loadgen.step_search(run_at, start_rate_per_s=20, slo_ms=250, factor=2,
                                           max_steps=6, num_refinements=1)
    finally:
        await sender.close()
        await server.stop(None)
    rates = [s["offered_rps"] for s in result["steps"]]
    assert rates[:3] == [20, 40, 80]
    # Above capacity the backlog grows for the whole step, so p99 breaks the SLO there ...
    assert all(not loadgen.within_slo(s, 250) for s in result["steps"] if s["offered_rps"] > 1.2 * capacity_rps)
    assert "SLO" in result["limit"]
    # ... and the sustainable rate found is a rate that met it, at or below the capacity.
    assert 20 <= result["sustainable_rps"] <= capacity_rps
    assert loadgen.within_slo(result["sustainable"], 250)


async def test_a_generator_that_cannot_keep_up_says_so():
    async def blocking_send(texts):
        time.sleep(0.03)  # holds the event loop: later arrivals cannot leave on time
        return loadgen.Reply("OK")

    arrivals = arrivals_at([i * 0.005 for i in range(60)])  # 200 req/s offered
    samples = await loadgen.run_open_loop(blocking_send, arrivals)
    summary = loadgen.summarize(samples, offered_rate_per_s=200)
    assert summary["generator_kept_up"] is False
    assert summary["send_lag_ms"]["max"] >= 500  # 60 x 30 ms of blocking against 300 ms of schedule
    # Each reply is instant, yet the late requests' latencies carry the generator's own delay.
    assert all(s.latency_ms >= s.send_lag_ms for s in samples)
    assert max(s.latency_ms for s in samples) >= 500
    assert not loadgen.within_slo(summary, slo_ms=1e9)
    assert "load generator fell behind" in loadgen.failure_reason(summary, slo_ms=1e9)


def test_poisson_schedule_offers_the_rate_in_order():
    queries = [workload.Query(i, 5, 0.0, f"q{i}") for i in range(50)]
    arrivals = loadgen.poisson_schedule(queries, rate_per_s=200, duration_s=20, seed=7)
    times = [a.t_s for a in arrivals]
    assert times == sorted(times) and times[-1] < 20
    assert 0.9 * 4000 <= len(arrivals) <= 1.1 * 4000
    assert arrivals[51].texts == ("q1",)  # queries are reused in order


def test_replay_schedule_rescales_the_workload_to_the_mean_rate():
    queries = workload.generate(1000, seed=5, rate_per_s=400.0)
    queries = [workload.Query(q.id, q.num_tokens, q.t_s, "q") for q in queries]
    native_span_s = queries[-1].t_s - queries[0].t_s
    rate = 100.0
    # Two laps of the workload at a quarter of its native rate.
    duration_s = 2 * len(queries) / rate
    arrivals = loadgen.replay_schedule(queries, rate, duration_s)
    assert 0.97 * 2000 <= len(arrivals) <= 2000
    times = [a.t_s for a in arrivals]
    assert times == sorted(times)
    # Gaps keep their shape: the first lap is the workload's own times, stretched.
    scale = times[999] / (queries[999].t_s - queries[0].t_s)
    assert scale == pytest.approx(len(queries) / native_span_s / rate, rel=0.01)
    assert [a.num_tokens for a in arrivals[:10]] == [q.num_tokens for q in queries[:10]]


def test_texts_for_lengths_gives_wordpiece_texts_of_each_length(bundled_model_dir):
    from transformers import AutoTokenizer

    vocab = [w.strip() for w in open(bundled_model_dir / "vocab.txt", encoding="utf-8")
             if w.strip().isalpha() and w.strip().islower() and len(w.strip()) > 2]
    queries = [workload.Query(i, n, 0.0) for i, n in enumerate([3, 4, 10, 40])]
    tok = AutoTokenizer.from_pretrained(str(bundled_model_dir))
    for q in loadgen.texts_for_lengths(queries, vocab):
        assert len(tok(q.text)["input_ids"]) == q.num_tokens


def test_summary_rates_cover_the_schedule_and_count_failures_in_latency():
    # 8 requests scheduled over 2 s; the last reply comes at 2.5 s; one failed after 1 s.
    samples = [loadgen.Sample(i * 0.25, i * 0.25, i * 0.25 + 0.1, "OK", 10, 1.0, 2.0) for i in range(7)]
    samples.append(loadgen.Sample(1.5, 1.5, 2.5, "UNAVAILABLE", 10, 0.0, 0.0))
    summary = loadgen.summarize(samples, offered_rate_per_s=5, duration_s=2.0)
    assert summary["scheduled_rps"] == 4.0
    assert summary["throughput_rps"] == pytest.approx(7 / 2.5)
    assert summary["tokens_per_s"] == pytest.approx(70 / 2.5, abs=0.1)
    assert summary["errors"] == {"UNAVAILABLE": 1}
    assert summary["latency_ms"]["max"] == pytest.approx(1000)
    assert summary["server_inference_ms"]["p50"] == 2.0  # from successful replies only


class EmbeddingsHandler(BaseHTTPRequestHandler):
    """An OpenAI-style /embeddings endpoint (Infinity's API) that answers after ``delay_s``."""

    delay_s = 0.0

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        time.sleep(self.delay_s)
        payload = json.dumps({"data": [{"embedding": [1.0, 0.0]} for _ in body["input"]]}).encode()
        try:
            self.send_response(200 if self.path == "/embeddings" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except BrokenPipeError:  # the client's deadline passed first: what the test wants
            pass

    def log_message(self, *args):
        pass


async def test_http_sender_reports_ok_and_enforces_the_whole_deadline():
    from tokq.profiling.bench.service.systems import HttpSender

    server = ThreadingHTTPServer(("127.0.0.1", 0), EmbeddingsHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base_url = f"http://127.0.0.1:{server.server_address[1]}"
    sender = HttpSender(base_url, "m", timeout_s=0.3)
    try:
        ok = await sender(["a", "b"])
        EmbeddingsHandler.delay_s = 1.0
        late = await sender(["a"])
    finally:
        EmbeddingsHandler.delay_s = 0.0
        await sender.close()
        server.shutdown()
        server.server_close()
    assert ok.status == "OK" and ok.queue_ms is None  # Infinity reports no server timings
    assert late.status == "DEADLINE_EXCEEDED"


def run_summary(rate: float, latency_ms: float, send_lag_ms: float = 0.0) -> dict:
    """A 100-request run at ``rate`` whose sends were ``send_lag_ms`` late."""
    samples = [loadgen.Sample(i / rate, i / rate + send_lag_ms / 1000, i / rate + latency_ms / 1000,
                              "OK", 10, None, None) for i in range(100)]
    return loadgen.summarize(samples, rate)


async def test_step_search_runs_a_rate_again_when_the_generator_fell_behind():
    calls: list[float] = []
    behind_at = {40.0: 1}  # the first run at 40 req/s is held up by the generator, the retry is not

    async def run_at(rate: float) -> dict:
        calls.append(rate)
        if behind_at.get(rate, 0) > 0:
            behind_at[rate] -= 1
            return run_summary(rate, 500, send_lag_ms=400)
        return run_summary(rate, 50 if rate <= 80 else 900)

    result = await loadgen.step_search(run_at, start_rate_per_s=20, slo_ms=250, factor=2, num_refinements=0)
    assert calls == [20, 40, 40, 80, 160]
    assert result["sustainable_rps"] == 80 and not result["generator_limited"]
    assert "SLO" in result["limit"]


async def test_step_search_comes_down_when_the_first_rate_already_fails():
    """A system slower than the start rate (one-at-a-time on a deep model) is not scored 0."""
    async def run_at(rate: float) -> dict:
        return run_summary(rate, 50 if rate <= 12 else 900)

    result = await loadgen.step_search(run_at, start_rate_per_s=50, slo_ms=250, factor=2, num_refinements=1)
    rates = [s["offered_rps"] for s in result["steps"]]
    assert rates[:4] == [50, 25, 12.5, 6.25]  # down until one meets the SLO ...
    assert rates[4] == pytest.approx((6.25 * 12.5) ** 0.5, rel=1e-3)  # ... then bisected against the lowest failure
    assert result["sustainable_rps"] == pytest.approx(rates[4]) and "SLO" in result["limit"]

    async def never(rate: float) -> dict:
        return run_summary(rate, 900)

    result = await loadgen.step_search(never, start_rate_per_s=50, slo_ms=250, factor=2, max_steps=4)
    assert [s["offered_rps"] for s in result["steps"]] == [50, 25, 12.5, 6.25]
    assert result["sustainable_rps"] == 0.0 and result["sustainable"] is None
    # The service bench's defaults (25 req/s, x1.3, 20 steps of 4 s) stop before a step of
    # fewer than 20 requests, not at a rate too low to send any.
    result = await loadgen.step_search(never, start_rate_per_s=25, slo_ms=250, factor=1.3, max_steps=20,
                                       min_rate_per_s=20 / 4.0)
    rates = [s["offered_rps"] for s in result["steps"]]
    assert len(rates) == 7 and rates[-1] * 4.0 >= 20 and rates[-1] / 1.3 * 4.0 < 20
    assert result["sustainable_rps"] == 0.0 and "SLO" in result["limit"]


async def test_step_search_does_not_come_down_from_a_rate_the_generator_could_not_send():
    """A first step lost to the load generator says nothing about the server: no step-down."""
    async def run_at(rate: float) -> dict:
        return run_summary(rate, 900, send_lag_ms=400)

    result = await loadgen.step_search(run_at, start_rate_per_s=50, slo_ms=250, factor=2)
    assert [s["offered_rps"] for s in result["steps"]] == [50, 50]  # run again once, then given up
    assert result["sustainable_rps"] == 0.0 and result["generator_limited"]
    assert result["limit"].startswith("load generator fell behind")


async def test_step_search_says_when_only_the_generator_limits_it():
    async def run_at(rate: float) -> dict:
        return run_summary(rate, 50, send_lag_ms=400 if rate >= 40 else 0)

    result = await loadgen.step_search(run_at, start_rate_per_s=20, slo_ms=250, factor=2)
    assert [s["offered_rps"] for s in result["steps"]] == [20, 40, 40]  # no bisection against it
    assert result["sustainable_rps"] == 20 and result["generator_limited"]
    assert result["limit"].startswith("load generator fell behind")


async def test_a_closed_loop_keeps_its_calls_in_flight_and_records_every_one():
    in_flight = peak = 0

    async def send(texts):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return loadgen.Reply("OK", 1.0, 2.0)

    samples = await loadgen.run_closed_loop(send, arrivals_at([5.0] * 40), concurrency=8)
    assert len(samples) == 40 and peak == 8 and all(s.status == "OK" for s in samples)
    assert max(s.done_s for s in samples) < 1.0  # the schedule's times are ignored
