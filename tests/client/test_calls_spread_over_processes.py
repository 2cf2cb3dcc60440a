"""One client spreads its calls over the gateway's processes: `tokq gateway --procs 2` (real
processes sharing a port by SO_REUSEPORT, each with its own metrics port), a real worker, and
the per-process Embed counts read from each process's Prometheus page."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from service_stack import ServiceStack, embed_counts

from tokq import AsyncClient, Client
from tokq import client as client_module
from tokq.client import DISCOVERY_MISSES, REDISCOVER_FIRST_S, REDISCOVER_MAX_S, _Pool
from tokq.redis.embedded import free_port_block
from tokq.v1 import embedder_pb2 as pb
from tokq.v1 import embedder_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow
NUM_CALLS = 200


@pytest.fixture(scope="module")
def stack():
    s = ServiceStack(http=True)
    metrics_port = free_port_block(2)  # the second process serves metrics on the next port
    s.metrics_ports = [metrics_port, metrics_port + 1]
    try:
        s.start_gateway("--procs", "2", "--metrics-port", str(metrics_port))
        deadline = time.monotonic() + 90
        while True:  # the health check answered from one process; wait for both
            try:
                embed_counts(s.metrics_ports)
                break
            except OSError:
                assert time.monotonic() < deadline, "a gateway process never served metrics"
                time.sleep(0.2)
        s.start_worker("w1")
        yield s
    finally:
        s.close()


def split_of(stack, run) -> list[float]:
    before = embed_counts(stack.metrics_ports)
    run()
    return [a - b for a, b in zip(embed_counts(stack.metrics_ports), before)]


def assert_even(split: list[float]) -> None:
    assert sum(split) == NUM_CALLS, split
    for count in split:
        assert abs(count - NUM_CALLS / 2) <= 0.2 * NUM_CALLS / 2, f"calls per process {split}"


def test_one_plain_grpc_channel_pins_one_gateway_process(stack):
    # The problem the client solves: every call of one channel goes down one connection.
    with grpc.insecure_channel(stack.target) as channel:
        stub = pb_grpc.EmbedderStub(channel)

        def run():
            with ThreadPoolExecutor(16) as pool:
                list(pool.map(lambda _: stub.Embed(pb.EmbedRequest(inputs=["red shoes"]), timeout=30),
                              range(NUM_CALLS)))

        assert sorted(split_of(stack, run)) == [0, NUM_CALLS]


def test_one_client_splits_concurrent_calls_evenly_between_processes(stack):
    with Client(stack.target) as client:
        for _ in range(2 * DISCOVERY_MISSES):  # a long-lived client has heard from its connections
            client.tokenize(["warm up"])
        assert set(client.processes()) - {None}, client.processes()

        def run():
            with ThreadPoolExecutor(16) as pool:
                vectors = list(pool.map(lambda i: client.embed([f"query {i}"], timeout=30), range(NUM_CALLS)))
            assert all(v.shape == (1, 384) for v in vectors)

        split = split_of(stack, run)
    assert_even(split)


def test_one_client_alternates_processes_for_calls_one_at_a_time(stack):
    with Client(stack.target, connections=2) as client:
        for _ in range(2 * DISCOVERY_MISSES):
            client.tokenize(["warm up"])
        split = split_of(stack, lambda: [client.embed([f"q {i}"], timeout=30) for i in range(NUM_CALLS)])
    assert_even(split)


def test_one_async_client_splits_calls_evenly_between_processes(stack):
    async def run_all():
        async with AsyncClient(stack.target) as client:
            for _ in range(2 * DISCOVERY_MISSES):
                await client.tokenize(["warm up"])
            before = embed_counts(stack.metrics_ports)
            results = await asyncio.gather(*(client.embed([f"query {i}"], timeout=30) for i in range(NUM_CALLS)))
            assert all(v.shape == (1, 384) for v in results)
            return [a - b for a, b in zip(embed_counts(stack.metrics_ports), before)]

    assert_even(asyncio.run(run_all()))


def test_a_name_with_several_addresses_is_spread_over_all_of_them(stack):
    # A headless Service's DNS name lists every pod; here: a second gateway on 127.0.0.2.
    import subprocess
    import sys

    other = subprocess.Popen([sys.executable, "-m", "tokq.cli", "gateway", "--host", "127.0.0.2",
                              "--port", str(stack.port), "--redis-url", stack.redis.url], env=stack.env)
    try:
        with Client(f"ipv4:127.0.0.2:{stack.port}") as probe:
            deadline = time.monotonic() + 90
            while True:
                try:
                    probe.info(timeout=1)
                    break
                except Exception:
                    assert other.poll() is None and time.monotonic() < deadline
                    time.sleep(0.2)
        with Client(f"ipv4:127.0.0.1:{stack.port},127.0.0.2:{stack.port}") as client:
            for _ in range(4 * DISCOVERY_MISSES):
                client.tokenize(["warm up"])
            pids = {process.rsplit(".", 2)[1] for process in client.processes() if process}
        assert str(other.pid) in pids and len(pids) >= 2, client.processes()
    finally:
        other.terminate()
        other.wait(timeout=30)


def test_http_clients_spread_over_processes_by_connection(stack):
    # HTTP/1.1 carries one request at a time per connection, so clients open many: here each
    # request its own connection, as SO_REUSEPORT hands connections out.
    import httpx

    def post(i):
        with httpx.Client(base_url=stack.http_url, timeout=30) as http:
            resp = http.post("/v1/embeddings", json={"input": f"query {i}"})
            assert resp.status_code == 200, resp.text

    before = embed_counts(stack.metrics_ports, "http.Embeddings")
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(post, range(NUM_CALLS)))
    split = [a - b for a, b in zip(embed_counts(stack.metrics_ports, "http.Embeddings"), before)]
    assert sum(split) == NUM_CALLS
    assert min(split) >= NUM_CALLS / 4, split  # binomial: 100 +- 7 each; under 50 is 7 sigma off


# -- the pool's rule, on real (unconnected) channels ----------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_pool(size: int, clock: Clock | None = None) -> tuple[_Pool, list]:
    opened = []

    def open_channel():
        opened.append(grpc.insecure_channel("127.0.0.1:9"))  # never called: no connection made
        return opened[-1]

    return _Pool(open_channel, size, clock or Clock()), opened


def test_calls_go_to_the_process_with_fewest_in_flight_not_the_connection():
    pool, _ = make_pool(4)
    a1, a2, a3, b = pool.connections
    for conn, process in ((a1, "A"), (a2, "A"), (a3, "A"), (b, "B")):
        conn.process = process
    pool._seen = {"A", "B"}
    taken = [pool.acquire() for _ in range(8)]
    assert sum(c is b for c in taken) == 4  # half the calls, on B's one connection
    assert {a1.outstanding, a2.outstanding, a3.outstanding} <= {1, 2} and b.outstanding == 4


def test_calls_one_at_a_time_take_processes_in_turn():
    pool, _ = make_pool(3)
    for conn, process in zip(pool.connections, ("A", "A", "B")):
        conn.process = process
    order = []
    for _ in range(6):
        conn = pool.acquire()
        order.append(conn.process)
        pool.release(conn, conn.process)
    assert order.count("A") == 3 and order.count("B") == 3


def identify(pool: _Pool, conn, process: str):
    """A call on ``conn`` answered by ``process``; what release() hands back to close."""
    conn.outstanding += 1
    return pool.release(conn, process)


def test_a_connection_not_yet_identified_takes_one_call_at_a_time():
    pool, _ = make_pool(3)
    known, fresh = pool.connections[0], pool.connections[1:]
    identify(pool, known, "A")
    taken = [pool.acquire() for _ in range(20)]
    assert all(c.outstanding == 1 for c in fresh) and known.outstanding == 18


def test_a_connection_that_reaches_a_known_process_is_reopened_a_bounded_number_of_times():
    pool, opened = make_pool(2)
    assert identify(pool, pool.connections[0], "A") is None  # the first to reach A is kept
    reopened = 0
    while True:
        dup = pool.connections[1]
        idle = identify(pool, dup, "A")  # it reached A too: reopened, and closed at once (idle)
        if idle is None:
            break
        assert idle is dup.channel and dup.retired and pool.connections[1] is not dup
        reopened += 1
    assert reopened == DISCOVERY_MISSES  # then it stops: there may be one process only
    assert len(opened) == 2 + DISCOVERY_MISSES and pool.processes() == {"A": 2} and pool.retired == []


def test_a_new_process_found_resets_the_search():
    pool, _ = make_pool(2)
    identify(pool, pool.connections[0], "A")
    for _ in range(DISCOVERY_MISSES - 1):
        identify(pool, pool.connections[1], "A")
    assert identify(pool, pool.connections[1], "B") is None
    assert pool.processes() == {"A": 1, "B": 1}
    identify(pool, pool.connections[0], "A")  # no change: nothing reopened
    assert pool.processes() == {"A": 1, "B": 1}


def test_after_the_first_search_a_doubled_up_connection_is_reopened_now_and_again_less_often():
    """A gateway restarted: its processes may listen one after another, so the search goes on
    after its first burst, each wait twice the last up to REDISCOVER_MAX_S, from the start again
    once a new process is found."""
    clock = Clock()
    pool, opened = make_pool(2, clock)
    identify(pool, pool.connections[0], "A")
    while identify(pool, pool.connections[1], "A") is not None:  # the first search, spent
        pass
    reopen_times = []
    for _ in range(1000):
        clock.now += 1.0
        if identify(pool, pool.connections[1], "A") is not None:
            reopen_times.append(clock.now)
    waits = [b - a for a, b in zip(reopen_times, reopen_times[1:])]
    assert reopen_times[0] - 1000.0 == pytest.approx(REDISCOVER_FIRST_S, abs=1.0)
    assert waits[0] == pytest.approx(2 * REDISCOVER_FIRST_S, abs=1.0)
    assert all(b >= a for a, b in zip(waits, waits[1:]))
    assert max(waits) == pytest.approx(REDISCOVER_MAX_S, abs=1.0)
    assert len(opened) == 2 + DISCOVERY_MISSES + len(reopen_times)
    clock.now += REDISCOVER_MAX_S
    assert identify(pool, pool.connections[1], "A") is not None  # reopened: it finds B
    assert identify(pool, pool.connections[1], "B") is None
    assert pool.processes() == {"A": 1, "B": 1}
    clock.now += REDISCOVER_MAX_S
    assert identify(pool, pool.connections[0], "A") is None  # nothing doubled up: no search


def test_processes_listening_one_after_another_are_all_found():
    """A restart whose three processes listen a minute apart: the search goes on after each new
    one is found, until every process is reached (4 connections)."""
    import random

    rng = random.Random(5)
    clock = Clock()
    pool, _ = make_pool(4, clock)
    start = clock.now
    for _ in range(3600):  # a call a second for an hour, each connection's reply in turn
        listening = ["A", "B", "C"][:1 + int((clock.now - start) // 60)]
        for conn in list(pool.connections):
            if conn.process not in listening:
                conn.process = None  # (re)connected: lands on a process listening now
            identify(pool, conn, conn.process or rng.choice(listening))
        clock.now += 1.0
    assert set(pool.processes()) == {"A", "B", "C"}, pool.processes()


def test_a_process_that_answered_unavailable_is_passed_over_for_a_moment():
    clock = Clock()
    pool, _ = make_pool(2, clock)
    a, b = pool.connections
    identify(pool, a, "A")
    identify(pool, b, "B")
    b.outstanding += 1
    pool.release(b, "B", grpc.StatusCode.UNAVAILABLE)  # failed fast: B looks idle
    taken = [pool.acquire() for _ in range(4)]
    assert all(c is a for c in taken)  # though A has more in flight
    clock.now += client_module.BACKOFF_S
    assert pool.acquire() is b
    b.outstanding += 1
    pool.release(b, "B", grpc.StatusCode.INVALID_ARGUMENT)  # the caller's fault, not B's
    assert pool.acquire() is b
    pool.release(b, "B", grpc.StatusCode.RESOURCE_EXHAUSTED)  # the queue's cap: shared by all
    assert pool.acquire() is b
    pool.release(a, "A", grpc.StatusCode.UNAVAILABLE)
    pool.release(b, "B", grpc.StatusCode.UNAVAILABLE)
    assert pool.acquire() in (a, b)  # every process passed over: calls still go somewhere


def test_a_closed_pool_starts_no_call_and_opens_no_connection():
    pool, opened = make_pool(2)
    identify(pool, pool.connections[0], "A")
    dup = pool.connections[1]
    dup.outstanding += 1
    channels = pool.close()
    assert set(channels) == set(opened)
    assert pool.release(dup, "A") is None  # it reached A too, but no replacement opens now
    assert len(opened) == 2 and not dup.retired
    with pytest.raises(ValueError, match="closed"):
        pool.acquire()


def test_a_replaced_connection_closes_only_after_its_calls_finish():
    pool, _ = make_pool(2)
    identify(pool, pool.connections[0], "A")
    dup = pool.connections[1]
    dup.outstanding = 3
    assert pool.release(dup, "A") is None  # replaced, but two calls are still on it
    assert dup.retired and dup in pool.retired and dup not in pool.connections
    assert pool.release(dup, "A") is None
    assert pool.release(dup, None) is dup.channel and pool.retired == []


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4"])
def test_connections_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="connections"):
        Client("127.0.0.1:9", connections=bad)


def queue_series(metrics_ports: list[int]) -> list[list[str]]:
    """Per gateway process, the tokq_queue_* series names its metrics page shows."""
    out = []
    for port in metrics_ports:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        out.append(sorted(s.name for family in text_string_to_metric_families(text)
                          for s in family.samples if s.name.startswith("tokq_queue_")))
    return out


def test_one_gateway_process_exports_the_queue_metrics(stack):
    """The queue is one shared state: one process exports it (a Redis lock elects it), so a
    sum() over every process's scrape counts each figure once. It is the first process, on
    --metrics-port itself: a scrape config that names the gateway's port (deploy/'s) saw no
    queue metrics whenever another process won the lock."""
    deadline = time.monotonic() + 30
    while not any(series := queue_series(stack.metrics_ports)):
        assert time.monotonic() < deadline, "no gateway process exported the queue metrics"
        time.sleep(0.5)
    time.sleep(5)  # past two export periods: had the other process been elected too, it shows now
    series = queue_series(stack.metrics_ports)
    exporting = [names for names in series if names]
    assert len(exporting) == 1 and series[0], series
    assert "tokq_queue_queued_tokens" in exporting[0] and "tokq_queue_acked_total" in exporting[0]
    assert stack.client().exists(stack.keys.metrics_exporter)
