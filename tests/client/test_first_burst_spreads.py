"""A new client's first burst of calls spreads over every gateway process: it waits for Info
probes on its connections and on extra ones opened at once, then spreads its calls by process.
Against `tokq gateway --procs 2` with a real worker, against stand-in processes sharing a port
by SO_REUSEPORT, and the pool's rule on unconnected channels."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from service_stack import ServiceStack, embed_counts

from tokq import AsyncClient, Client, TokqError
from tokq.client import DEFAULT_CONNECTIONS, DISCOVERY_MISSES, FIRST_SEARCH_WAIT_S, GATEWAY_ID_METADATA, _Pool
from tokq.redis.embedded import free_port, free_port_block
from tokq.v1 import embedder_pb2 as pb
from tokq.v1 import embedder_pb2_grpc as pb_grpc

BURST = 300


def assert_spread(split: list[int], calls: int = BURST) -> None:
    """Every process took its share of ``calls``, within +-25%."""
    assert sum(split) == calls, split
    share = calls / len(split)
    assert all(abs(n - share) <= 0.25 * share for n in split), f"calls per process {split}"


def thread_burst(client: Client, calls: int = BURST, timeout: float = 60) -> None:
    """``calls`` single-input Embed calls from as many threads, released together."""
    barrier = threading.Barrier(calls)
    failures = []

    def one(i: int) -> None:
        barrier.wait()
        try:
            client.embed([f"query {i}"], timeout=timeout)
        except TokqError as exc:
            failures.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[:3]


async def coroutine_burst(client: AsyncClient, calls: int = BURST, timeout: float = 60) -> None:
    await asyncio.gather(*(client.embed([f"query {i}"], timeout=timeout) for i in range(calls)))


# -- tokq gateway --procs 2, as a new user runs it -------------------------------------------------

@pytest.fixture(scope="module")
def stack():
    s = ServiceStack()
    metrics_port = free_port_block(2)
    s.metrics_ports = [metrics_port, metrics_port + 1]
    try:
        s.start_gateway("--procs", "2", "--metrics-port", str(metrics_port))
        s.start_worker("w1")
        s.wait_ready(120)  # SERVING: every process listens
        yield s
    finally:
        s.close()


def split_of(stack, run) -> list[int]:
    before = embed_counts(stack.metrics_ports)
    run()
    return [int(a - b) for a, b in zip(embed_counts(stack.metrics_ports), before)]


@pytest.mark.slow
def test_a_new_clients_first_burst_from_threads_spreads_over_both_processes(stack):
    for _ in range(3):  # each a new client: its connections land anew
        with Client(stack.target) as client:
            split = split_of(stack, lambda: thread_burst(client))
        assert_spread(split)


@pytest.mark.slow
def test_a_new_async_clients_first_burst_spreads_over_both_processes(stack):
    async def burst() -> list[int]:
        async with AsyncClient(stack.target) as client:
            before = embed_counts(stack.metrics_ports)
            await coroutine_burst(client)
            return [int(a - b) for a, b in zip(embed_counts(stack.metrics_ports), before)]

    for _ in range(3):
        assert_spread(asyncio.run(burst()))


# -- stand-in gateway processes ---------------------------------------------------------------------

class StandIn(pb_grpc.EmbedderServicer):
    """A gateway process naming itself (or not: ``name`` None) in its trailing metadata."""

    def __init__(self, name: str | None, delay_s: float = 0.01) -> None:
        self.name, self.delay_s = name, delay_s
        self.embeds = self.infos = 0
        self._lock = threading.Lock()

    def _identify(self, context) -> None:
        if self.name:
            context.set_trailing_metadata(((GATEWAY_ID_METADATA, self.name),))

    def Embed(self, request, context):
        with self._lock:
            self.embeds += 1
        self._identify(context)
        time.sleep(self.delay_s)
        return pb.EmbedResponse(embeddings=[pb.Embedding(values=[1.0, 0.0]) for _ in request.inputs])

    def Info(self, request, context):
        with self._lock:
            self.infos += 1
        self._identify(context)
        return pb.InfoResponse(model="m")


class StandIns:
    def __init__(self, names: list[str | None]) -> None:
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.processes = [StandIn(name) for name in names]
        self.servers = []
        for servicer in self.processes:
            server = grpc.server(ThreadPoolExecutor(64), options=[("grpc.so_reuseport", 1)])
            pb_grpc.add_EmbedderServicer_to_server(servicer, server)
            assert server.add_insecure_port(self.target) == self.port
            server.start()
            self.servers.append(server)

    def embeds(self) -> list[int]:
        return [p.embeds for p in self.processes]

    def close(self) -> None:
        for server in self.servers:
            server.stop(None)


@pytest.fixture
def stand_ins():
    made = []

    def make(*names):
        made.append(StandIns(list(names)))
        return made[-1]

    yield make
    for group in made:
        group.close()


@pytest.mark.parametrize("names", [["A", "B"], ["A", "B", "C"]])
def test_the_first_burst_spreads_over_stand_in_processes(stand_ins, names):
    group = stand_ins(*names)
    for _ in range(3):
        before = group.embeds()
        with Client(group.target) as client:
            thread_burst(client, 150, timeout=30)
        assert_spread([a - b for a, b in zip(group.embeds(), before)], 150)


def test_the_first_async_burst_spreads_over_stand_in_processes(stand_ins):
    group = stand_ins("A", "B")

    async def burst():
        async with AsyncClient(group.target) as client:
            await coroutine_burst(client, 150, timeout=30)
            return client.processes()

    for _ in range(3):
        before = group.embeds()
        processes = asyncio.run(burst())
        assert_spread([a - b for a, b in zip(group.embeds(), before)], 150)
        assert processes == {"A": 2, "B": 2}


def test_the_search_keeps_as_many_connections_and_probes_once(stand_ins):
    group = stand_ins("A")
    with Client(group.target) as client:
        thread_burst(client, 50, timeout=30)
        assert client.processes() == {"A": DEFAULT_CONNECTIONS}
        assert client._pool.retired == []
        probes = group.processes[0].infos  # each connection not yet identified, and the extra ones
        assert DISCOVERY_MISSES < probes <= DEFAULT_CONNECTIONS + DISCOVERY_MISSES
        thread_burst(client, 50, timeout=30)
    assert group.processes[0].infos == probes  # searched once


def test_calls_one_at_a_time_send_no_probe(stand_ins):
    group = stand_ins("A", "B")
    with Client(group.target) as client:
        for i in range(20):
            client.embed([f"q {i}"], timeout=30)
    assert sum(p.infos for p in group.processes) == 0


def test_processes_that_name_no_one_hold_the_burst_only_for_the_probes(stand_ins):
    group = stand_ins(None, None)  # a proxy in front, say: no process named
    with Client(group.target) as client:
        started = time.monotonic()
        thread_burst(client, 50, timeout=30)
        assert time.monotonic() - started < FIRST_SEARCH_WAIT_S + 5
        assert client.processes() == {None: DEFAULT_CONNECTIONS}
    assert sum(group.embeds()) == 50


def test_a_burst_to_no_gateway_fails_unavailable_without_waiting_out_the_search():
    port = free_port()  # nothing listens: the probes fail at once
    with Client(f"127.0.0.1:{port}") as client:
        outcomes = []

        def one(_):
            started = time.monotonic()
            try:
                client.embed(["hi"], timeout=10)
            except TokqError as exc:
                outcomes.append((exc.code, time.monotonic() - started))

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(one, range(8)))
    assert {code for code, _ in outcomes} == {grpc.StatusCode.UNAVAILABLE}
    assert max(s for _, s in outcomes) < 5


def test_a_client_closed_during_its_search_ends_cleanly(stand_ins):
    group = stand_ins("A", "B")

    async def run():
        client = AsyncClient(group.target)
        calls = [asyncio.ensure_future(client.embed([f"q {i}"], timeout=30)) for i in range(20)]
        await asyncio.sleep(0)
        started = time.monotonic()
        await client.close()
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        return outcomes, time.monotonic() - started

    outcomes, took = asyncio.run(run())
    held = outcomes[1:]  # the first call went at once; the others waited for the search
    assert all(isinstance(o, ValueError) and "closed" in str(o) for o in held), held
    # the first, in flight, is stopped as grpc.aio stops a call whose channel closes
    assert isinstance(outcomes[0], (asyncio.CancelledError, TokqError)), outcomes[0]
    assert took < FIRST_SEARCH_WAIT_S, "held calls waited out the search instead of failing at once"


# -- the pool's rule, on unconnected channels -------------------------------------------------------

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


def begin_search(pool: _Pool) -> list:
    """A lone call, then a second while it is in flight: the second waits; the probes to send."""
    first = pool.acquire(wait=True)
    assert first is not None and pool.take_probes() == []  # a lone call goes at once, unprobed
    assert pool.acquire(wait=True) is None
    return pool.take_probes()


def test_a_second_call_in_flight_begins_the_search_and_waits():
    pool, opened = make_pool(4)
    probes = begin_search(pool)
    assert len(probes) == 4 + DISCOVERY_MISSES and len(opened) == 4 + DISCOVERY_MISSES
    assert pool.take_probes() == []  # each probe handed out once
    assert pool.acquire(wait=True) is None and pool.take_probes() == []
    assert pool.acquire() is not None  # without wait: as before


def test_the_search_keeps_connections_over_every_process_found():
    pool, opened = make_pool(4)
    probes = begin_search(pool)
    own, scouts = probes[:4], probes[4:]
    closing = []
    for conn in own:  # all four on A
        closing += pool.probe_done(conn, "A")
    closing += pool.probe_done(scouts[0], "B")
    for conn in scouts[1:-1]:
        closing += pool.probe_done(conn, "A")
    assert pool.searching and pool.acquire(wait=True) is None
    closing += pool.probe_done(scouts[-1], "C")  # the last answer ends the search
    assert not pool.searching
    assert sorted(pool.processes().items()) == [("A", 2), ("B", 1), ("C", 1)]
    # every other connection closes: at once when idle, the first call's once it returns
    kept = {id(c.channel) for c in pool.connections}
    assert len(closing) + len(pool.retired) == len(opened) - 4
    assert not kept & {id(ch) for ch in closing + [c.channel for c in pool.retired]}
    first = next(c for c in own if c.outstanding)
    assert (first in pool.retired) == all(first is not c for c in pool.connections)
    assert pool.acquire(wait=True) is not None and pool.take_probes() == []


def test_a_search_that_finds_nothing_keeps_the_connections_it_had():
    pool, _ = make_pool(4)
    probes = begin_search(pool)
    own = list(pool.connections)
    closing = [ch for conn in probes for ch in pool.probe_done(conn, None)]
    assert pool.connections == own and len(closing) == DISCOVERY_MISSES


def test_a_connection_its_call_replaced_during_the_search_closes_when_its_probe_answers():
    pool, _ = make_pool(2)
    first = pool.acquire(wait=True)
    pool.acquire(wait=True)
    probes = pool.take_probes()
    other = next(c for c in pool.connections if c is not first)
    pool.probe_done(other, "A")
    pool._seen.add("A")
    assert pool.release(first, "A") is None  # A again: reopened, its probe still out
    assert first.retired
    assert first.channel in pool.probe_done(first, "A")
    assert first not in pool.retired and first in probes


def test_calls_wait_no_longer_than_the_first_search_wait():
    clock = Clock()
    pool, _ = make_pool(2, clock)
    begin_search(pool)
    clock.now += FIRST_SEARCH_WAIT_S
    assert pool.acquire(wait=True) is not None  # probes still out: calls go anyway
    assert pool.searching


def test_no_search_once_calls_found_every_connection_its_own_process():
    pool, _ = make_pool(2)
    for conn, process in zip(pool.connections, "AB"):
        conn.outstanding += 1
        pool.release(conn, process)
    pool.acquire(wait=True)
    assert pool.acquire(wait=True) is not None and pool.take_probes() == []


def test_a_closed_pool_hands_back_its_scouts_too():
    pool, opened = make_pool(2)
    begin_search(pool)
    assert set(pool.close()) == set(opened)
    assert pool.take_probes() == []

