"""The pieces every benchmark shares, tested once: /proc CPU accounting, the CPU window, medians
and percentiles, the bare gRPC server, a helper process driven over lines (the gateway bench's
load client), Prometheus pages, and the py-spy summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import grpc
import pytest

from tokq.profiling import harness
from tokq.profiling.bench import gateway_cpu
from tokq.profiling.bench.proc_cpu import (children, cores_between, cpu_by_role, descendants, proc_cpu_s,
                                           proc_wakeups)

BURN = """
import threading, time, os
def burn():
    end = time.thread_time() + 0.3
    while time.thread_time() < end:
        pass
threads = [threading.Thread(target=burn) for _ in range(2)]
[t.start() for t in threads]; [t.join() for t in threads]
t = os.times()
print(t.user + t.system, flush=True)
input()
"""
WAKE = """
import threading, time
done, leave = threading.Semaphore(0), threading.Event()
def nap():
    for _ in range(50):
        time.sleep(0.001)
    done.release()
    leave.wait()  # alive while counted: an ended thread's switches leave /proc with it
threads = [threading.Thread(target=nap) for _ in range(2)]
print("ready", flush=True)
input()
[t.start() for t in threads]; done.acquire(); done.acquire()
print("slept", flush=True)
input()
leave.set()
"""


def test_proc_cpu_time_counts_every_thread_and_a_window_divides_it_by_calls_and_seconds():
    child = subprocess.Popen([sys.executable, "-c", BURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.pid in children(os.getpid()) and child.pid in descendants(os.getpid())
        own = float(child.stdout.readline())  # what the child says it used, all threads
        seen = proc_cpu_s(child.pid)
    finally:
        child.communicate("\n", timeout=30)
    assert own >= 0.6 and seen == pytest.approx(own, abs=0.05)  # /proc ticks are 10 ms
    assert cpu_by_role({"gone": [child.pid]}) == {"gone": {}}  # reaped: nothing to read, not an error
    # per role: a process that appeared in between counts from zero
    assert cores_between({"a": {1: 1.0}}, {"a": {1: 2.5, 2: 0.75}}, 3.0) == {"a": 0.75}
    with harness.CpuWindow({"me": os.getpid()}) as cpu:
        end = time.thread_time() + 0.2
        while time.thread_time() < end:
            pass
    assert cpu.cpu_s["me"] >= 0.15 and 0 < cpu.cores()["me"] <= 1.1
    assert cpu.ms_per(10)["me"] == pytest.approx(100 * cpu.cpu_s["me"])


def test_wakeups_count_the_context_switches_of_every_thread_of_a_process():
    child = subprocess.Popen([sys.executable, "-c", WAKE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        before = proc_wakeups(child.pid)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "slept"
        after = proc_wakeups(child.pid)
    finally:
        child.communicate("\n", timeout=30)
    assert after - before >= 2 * 50  # two threads, each asleep and woken 50 times


def test_rounds_give_medians_ratios_within_a_round_and_percentiles_by_rank():
    rounds = [{"a": {"x": 2.0}, "b": 1.0}, {"a": {"x": 9.0}, "b": 3.0}, {"a": {"x": 4.0}, "b": 4.0}]
    assert harness.median(rounds, "a", "x") == 4.0
    assert harness.ratio(rounds, ("a", "x"), ("b",)) == 2.0  # 2, 3, 1: not 4 / 3
    assert harness.medians(rounds) == {"a": {"x": 4.0}, "b": 3.0}
    order = []  # each round runs every config; with flip, every other round in reverse
    assert harness.interleaved(2, "ab", lambda c: order.append(c) or len(order), flip=True) == {"a": [1, 4], "b": [2, 3]}
    values = list(range(1, 501))
    assert harness.pct(values, 0.99) == 496 and harness.pct([], 0.99) == 0.0


@pytest.fixture(scope="module")
def echo():
    server = harness.BareServer()
    yield server
    server.close()


def test_the_bare_server_answers_a_unit_vector_or_refuses_unread(echo):
    from tokq.v1 import embedder_pb2 as pb
    from tokq.v1 import embedder_pb2_grpc as pb_grpc

    refusing = harness.BareServer(refuse=True)
    try:
        with grpc.insecure_channel(echo.target) as channel:
            reply = pb_grpc.EmbedderStub(channel).Embed(pb.EmbedRequest(inputs=["a", "b"]), timeout=30)
        assert len(reply.embeddings) == 2 and len(reply.embeddings[0].values) == harness.HIDDEN_SIZE
        with grpc.insecure_channel(refusing.target, harness.GRPC_LIMITS) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            assert stub.Info(pb.InfoRequest(), timeout=30) == pb.InfoResponse()
            with pytest.raises(grpc.RpcError) as refused:
                stub.Embed(pb.EmbedRequest(inputs=["x" * 100_000]), timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        refusing.close()


def test_a_measured_run_counts_each_process_over_the_measured_calls_only(echo):
    """The load client is a helper process: it warms up, says ready, runs on "go" and answers its
    summary while the parent reads every process's CPU time (closed loop here; the gateway bench's
    smoke test runs it open loop)."""
    pid = echo.proc.pid
    before = proc_cpu_s(pid)
    ticks = iter(range(100))
    run = gateway_cpu.measure(echo.target, {"echo server": pid}, load={"concurrency": 8}, calls=60, warmup_calls=20, seed=3,
                              workload=None, counters=lambda: {"probe": next(ticks)}, connections=1)
    summary = run["summary"]
    assert summary["num_requests"] == summary["num_ok"] == 60
    assert set(run["cpu_ms_per_call"]) == {"echo server", "load client"} and run["cpu_s"]["load client"] > 0
    assert 0 <= run["cpu_s"]["echo server"] <= proc_cpu_s(pid) - before + 1e-9  # warm-up calls not counted
    assert run["counters"] == {"probe": 1}  # read right before and right after the measured calls
    assert run["wakeups_per_call"]["echo server"] >= 1  # each call wakes the server's threads


def test_a_prometheus_page_is_summed_by_name_and_labels():
    from prometheus_client import CollectorRegistry, Counter, start_http_server

    from tokq.redis.embedded import free_port

    registry, port = CollectorRegistry(), free_port()
    calls = Counter("calls", "calls", ["rpc", "code"], registry=registry)
    calls.labels("Embed", "OK").inc(3)
    calls.labels("Embed", "UNAVAILABLE").inc(2)
    calls.labels("Info", "OK").inc(5)
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        assert harness.metric(url, "calls_total", rpc="Embed", code="OK") == 3
        assert harness.metrics(url, "calls_total", "absent_total") == {"calls_total": 10, "absent_total": 0.0}
    finally:
        server.shutdown()


def test_settle_waits_for_a_busy_process_to_go_quiet(tmp_path):
    started, done = tmp_path / "started", tmp_path / "done"
    busy = subprocess.Popen([sys.executable, "-c", "import sys, time\nopen(sys.argv[1], 'w').close()\n"
                             "end = time.time() + 1.5\nwhile time.time() < end: pass\n"
                             "open(sys.argv[2], 'w').close()\ntime.sleep(60)", str(started), str(done)])
    try:
        harness.wait_until(started.exists, "the busy process", [busy], timeout_s=60, poll_s=0.01)
        harness.settle(busy.pid, timeout_s=30)
        assert done.exists() and busy.poll() is None  # it returned once the process stopped spinning
    finally:
        busy.kill()
        busy.wait()
    with pytest.raises(TimeoutError, match="no nothing within 0 s"):
        harness.wait_until(lambda: False, "nothing", timeout_s=0.05)


def test_py_spy_stacks_leave_out_waits_and_merge_lines_of_a_function(tmp_path):
    import gzip

    collapsed = "\n".join([
        "thread (1): MainThread;run (asyncio/runners.py:190);_embed (gateway/service.py:10);encode (tokq/queue/wire.py:5) 6",
        "thread (1): MainThread;run (asyncio/runners.py:190);_embed (gateway/service.py:12);sendmsg (libc.so.6) 3",
        "thread (1): MainThread;run (asyncio/runners.py:190);select (selectors.py:468);epoll_wait (libc.so.6) 50",
        "thread (7): tokenize_0;_worker (concurrent/futures/thread.py:81);pthread_cond_timedwait (libc.so.6) 40",
        "thread (8): tokenize_1;_worker (concurrent/futures/thread.py:83);0x7f00 (tokenizers.abi3.so) 1"])
    frames = gateway_cpu.top_frames(collapsed)
    assert frames["samples"] == 100 and frames["busy_samples"] == 10
    assert dict(frames["threads"]) == {"MainThread": 0.9, "tokenize": 0.1}
    assert dict(frames["python"]) == {"encode (tokq/queue/wire.py)": 0.6, "_embed (gateway/service.py)": 0.3,
                                      "_worker (concurrent/futures/thread.py)": 0.1}
    assert dict(frames["native"]) == {"sendmsg (libc.so.6)": 0.3, "[tokenizers.abi3.so]": 0.1}
    # total time by Python frame; frames in 90% of busy samples or more (the loop's run) left out
    assert dict(frames["total"]) == {"encode (tokq/queue/wire.py)": 0.6, "_worker (concurrent/futures/thread.py)": 0.1}
    json.dumps(frames)  # goes into the report as is
    (tmp_path / "stacks.txt").write_text(collapsed)
    packed = gateway_cpu.gzip_file(tmp_path / "stacks.txt")
    assert packed.name == "stacks.txt.gz" and gzip.decompress(packed.read_bytes()).decode() == collapsed
