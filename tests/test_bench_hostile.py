"""The hostile-input benchmark's report: both p99 ratios, from the figures it was given."""

import subprocess
import sys
import time

from tokq.profiling.bench import hostile


def _report() -> dict:
    scenario = {"calls": 100, "idle_calls": 100, "idle_p50_ms": 10.0, "idle_p99_ms": 40.0,
                "abused_p50_ms": 12.0, "abused_p99_ms": 60.0, "p99_ratio": 1.5,
                "cpu_cores": {"gateway": 0.1, "worker": 0.9, "redis": 0.0, "abusers": 0.1, "probe": 0.0},
                "abuser_replies": {"OK": 5}, "probe_errors": {}}
    return {"limits": {"max_input_bytes": 65536, "max_request_bytes": 2097152},
            "load_average": (1.0, 1.0, 1.0), "rounds": 1, "phase_s": 1.0, "pace_s": 0.02,
            "scenarios": {"big": scenario}, "idle_p99_ms_all": 20.0,
            "reference": {"scenario": "big", "servers": {
                "tokq gateway": {"idle_p50_ms": 2.0, "idle_p99_ms": 3.0, "abused_p50_ms": 5.0,
                                 "abused_p99_ms": 15.0, "p99_ratio": 5.0, "calls": 100,
                                 "abuser_replies": 400, "server_cores": 1.0, "cpu_ms_per_reply": 2.5},
                "bare grpc.aio server": {"idle_p50_ms": 1.0, "idle_p99_ms": 2.0, "abused_p50_ms": 4.0,
                                         "abused_p99_ms": 16.0, "p99_ratio": 8.0, "calls": 100,
                                         "abuser_replies": 800, "server_cores": 1.2,
                                         "cpu_ms_per_reply": 1.5}}}}


def test_render_gives_the_ratio_to_its_own_idle_phases_and_to_all_of_them():
    text = hostile.render(_report(), "tokq bench hostile")
    row = next(line for line in text.splitlines() if line.startswith("| big |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[4] == "**1.50x**"  # 60 / 40, its own idle phases
    assert cells[5] == "3.00x"  # 60 / 20, all idle phases pooled
    assert "(20.0 ms)" in text
    bare = next(line for line in text.splitlines() if line.startswith("| bare grpc.aio server |"))
    assert [c.strip() for c in bare.strip("|").split("|")][3] == "8.00x"
    assert "p99 8.0x on a gRPC Python server that does nothing with them, 5.0x on the gateway" in text
    assert "1.5 ms of CPU each (1.20 cores), the gateway 2.5 ms" in text


def test_the_reference_server_refuses_embed_unread_and_answers_info():
    import multiprocessing

    import grpc

    from tokq.redis.embedded import free_port
    from tokq.v1 import embedder_pb2 as pb
    from tokq.v1 import embedder_pb2_grpc as pb_grpc

    ctx = multiprocessing.get_context("spawn")
    port, ready = free_port(), ctx.Event()
    server = ctx.Process(target=hostile._bare_server, args=(port, ready), daemon=True)
    server.start()
    try:
        assert ready.wait(120)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.EmbedderStub(channel)
            assert stub.Info(pb.InfoRequest(), timeout=30) == pb.InfoResponse()
            try:
                stub.Embed(pb.EmbedRequest(inputs=["x" * 100_000]), timeout=30)
                raise AssertionError("Embed was answered")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        server.kill()
        server.join(10)


def test_settle_waits_for_a_busy_process_to_go_quiet(tmp_path):
    started, done = tmp_path / "started", tmp_path / "done"
    busy = subprocess.Popen([sys.executable, "-c", "import sys, time\nopen(sys.argv[1], 'w').close()\n"
                             "end = time.time() + 1.5\nwhile time.time() < end: pass\n"
                             "open(sys.argv[2], 'w').close()\ntime.sleep(60)", str(started), str(done)])
    try:
        deadline = time.monotonic() + 60
        while not started.exists():  # its start-up (idle while it reads files) is not the test
            assert time.monotonic() < deadline and busy.poll() is None
            time.sleep(0.01)
        hostile._settle(busy.pid, timeout_s=30)
        assert done.exists()  # it returned only once the process stopped spinning
        assert busy.poll() is None
    finally:
        busy.kill()
        busy.wait()


def test_drain_waits_for_an_empty_queue_and_an_idle_worker(redis_url):
    """An idle phase starts only once nothing is queued or in flight and the worker has
    registered as idle (a worker still finishing claimed work would be measured otherwise)."""
    import redis

    from tokq.queue.keys import QueueKeys

    keys = QueueKeys("hostile-drain")
    r = redis.Redis.from_url(redis_url)
    try:
        r.set(keys.tokens, 0)
        r.set(keys.inflight, 3)
        r.sadd(keys.idle, "w1")
        assert not hostile._drain(r, keys, timeout_s=0.5)  # work in flight
        r.set(keys.inflight, 0)
        r.srem(keys.idle, "w1")
        assert not hostile._drain(r, keys, timeout_s=0.5)  # queue empty, but the worker is busy
        r.sadd(keys.idle, "w1")
        assert hostile._drain(r, keys, timeout_s=5)
    finally:
        r.delete(keys.tokens, keys.inflight, keys.idle)
        r.close()
