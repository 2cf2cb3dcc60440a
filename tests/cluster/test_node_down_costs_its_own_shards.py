"""Notices on a real 3-primary, 3-replica Redis Cluster: every node's subscription read at once,
and one node out (killed with its replica) costing only its own shards.

- A message published on any node is delivered at once, not after the reader has waited out
  its timeout on the other nodes' connections (redis-py's ClusterPubSub reads the nodes in turn:
  a notice on the third node waited up to twice the read timeout).
- With one primary and its replica killed: the subscriber reports that node's channels lost
  (once) and keeps delivering the others'; once the node is back, its channels are subscribed
  again. The gateway's calls waiting on that node's shards are answered UNAVAILABLE at once,
  those on the other shards are answered normally, new calls on them too; the queue stats sum
  the shards that answer and name the others. A worker goes on hearing the live shards' work
  notices (before, its whole subscription failed and it only found work by its 0.5 s claims).
- A primary killed alone: the calls waiting on its shards are answered UNAVAILABLE at once, not
  after the failover; once its replica has taken over, calls there are answered by notices.

The cluster is this module's own: nodes are killed; the ``healthy`` fixture starts them again
(only when a test needs them: the last two tests share one dead pair)."""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import numpy as np
import pytest
from cluster_support import local_cluster
from queue_support import wait_for

from tokq.config import GatewayConfig, QueueConfig
from tokq.redis.connection import close_client, connect, connect_pubsub
from tokq.queue.wire import encode_ok
from tokq.gateway.embedding import EmbedInput, ServedModel, Timer
from tokq.gateway.errors import Unavailable, code_of
from tokq.gateway.replies import ReplyRouter
from tokq.queue.keys import QueueKeys, shard_queue_name
from tokq.model.info import ModelInfo
from tokq.testing.cluster import LocalCluster
from tokq.queue.sharded import ShardedQueue
from tokq.redis.pubsub import ShardedSubscriber

pytestmark = pytest.mark.slow

READ_TIMEOUT_S = 0.5  # what the worker reads its notices with
DELIVERED_WITHIN_S = 0.2  # a correctness bound (the old reader took up to 2 x READ_TIMEOUT_S)
SHARDS = 6
GATEWAY = "gw-node-down"


@pytest.fixture(scope="module")
def cluster():
    with local_cluster() as cluster:
        yield cluster


@pytest.fixture
def healthy(cluster):
    """The cluster with every node running, flushed."""
    for node in cluster.nodes:
        if not node.running:
            cluster.restart(node.port)
    cluster.flushall()
    return cluster


@pytest.fixture(scope="module")
def info(bundled_model_dir):
    return ModelInfo.load(bundled_model_dir)


def _kill_pair(cluster: LocalCluster, primary: int) -> list[int]:
    """Kill a primary and its replicas (its slots then have no server at all)."""
    victims = [primary, *cluster.replica_ports_of(primary)]
    for port in victims:
        cluster.kill(port)
    return victims


def _restart(cluster: LocalCluster, ports: list[int]) -> None:
    for port in ports:
        cluster.restart(port)


async def _delivered_within(sub: ShardedSubscriber, publisher, channel: str, data: bytes) -> float:
    """Publish one message and read it; the seconds it took."""
    start = time.perf_counter()
    await publisher.spublish(channel, data)
    while True:
        msg = await sub.get_message(timeout=READ_TIMEOUT_S)
        if msg is not None:
            assert msg == (channel.encode(), data)
            return time.perf_counter() - start
        assert time.perf_counter() - start < 5, f"nothing delivered on {channel}"


def _channels_on_every_node(cluster: LocalCluster, count: int = 9) -> dict[str, int]:
    channels = {ch: cluster.owner_port(ch)
                for ch in (QueueKeys(f"spread{i}").notice_channel("gw") for i in range(count))}
    assert len(set(channels.values())) == 3, channels
    return channels


async def test_a_message_on_any_node_is_delivered_at_once(healthy):
    channels = _channels_on_every_node(healthy)
    publisher, sub = connect(healthy.url), ShardedSubscriber(connect_pubsub(healthy.url))
    try:
        await sub.subscribe(*channels)
        took = {}
        for round_ in range(3):
            for channel in channels:  # one at a time: nothing else wakes the reader
                took[channel, round_] = await _delivered_within(sub, publisher, channel, b"n")
        slow = {k: round(v, 3) for k, v in took.items() if v >= DELIVERED_WITHIN_S}
        assert not slow, f"delivered late (s): {slow}"
    finally:
        await sub.aclose()
        await close_client(publisher)


async def test_a_dead_node_costs_its_own_channels_only_and_they_come_back(healthy):
    channels = _channels_on_every_node(healthy)
    victim = channels[next(iter(channels))]
    lost_expected = sorted(ch for ch, port in channels.items() if port == victim)
    live = [ch for ch, port in channels.items() if port != victim]
    downs: list[tuple[list[str], BaseException]] = []
    ups: list[list[str]] = []
    publisher = connect(healthy.url)
    sub = ShardedSubscriber(connect_pubsub(healthy.url),
                            on_down=lambda chs, exc: downs.append((chs, exc)), on_up=ups.append)
    killed: list[int] = []
    try:
        await sub.subscribe(*channels)
        assert not downs and sorted(ups[0]) == sorted(channels)
        killed = await asyncio.to_thread(_kill_pair, healthy, victim)
        start = time.monotonic()

        async def reported():
            return bool(downs)
        await wait_for(reported, 10, "the dead node's channels to be reported down")
        assert time.monotonic() - start < 3  # the broken connection is noticed at once
        assert sorted(downs[0][0]) == lost_expected and len(downs) == 1
        assert sorted(sub.down) == lost_expected
        for channel in live:  # the other nodes keep delivering, at once
            took = await _delivered_within(sub, publisher, channel, b"live")
            assert took < DELIVERED_WITHIN_S, (channel, took)
        await asyncio.sleep(1.5)  # several resubscribe attempts fail meanwhile
        assert len(downs) == 1  # reported once per outage, not once per attempt

        await asyncio.to_thread(_restart, healthy, killed)
        killed = []

        async def back():
            return not sub.down
        await wait_for(back, 20, "the dead node's channels to be subscribed again")
        assert sorted(ups[-1]) == lost_expected
        for channel in channels:
            took = await _delivered_within(sub, publisher, channel, b"back")
            assert took < DELIVERED_WITHIN_S, (channel, took)
    finally:
        await sub.aclose()
        await close_client(publisher)
        if killed:
            await asyncio.to_thread(_restart, healthy, killed)


async def _answer_shard(queue: ShardedQueue, shard: int) -> int:
    """Claim and answer (as a worker would: input i, 4 floats of i + 1) what shard ``shard``
    holds; the number of entries answered."""
    answered = 0
    while (claim := await queue.shard(shard).claim(4096)) is not None:
        await queue.shard(shard).ack(claim.batch_id, [
            (e, encode_ok(np.full(4, e.index + 1, np.float32), 1.0, 2.0)) for e in claim.entries])
        answered += len(claim.entries)
    return answered


async def test_a_failover_fails_its_shards_waiting_calls_at_once_then_serves_them_again(
        healthy, info, tokenizer):
    # The README: when a primary dies, the calls waiting on its shards are answered UNAVAILABLE
    # at once (not after the failover, nor at their deadline); once its replica has taken over,
    # the gateway is subscribed there again and new calls on those shards are answered by
    # their notices (the poll is an hour away).
    client, pubsub = connect(healthy.url), connect_pubsub(healthy.url)
    queue = ShardedQueue(client, "failover", QueueConfig(queue_shards=SHARDS))
    owner = [healthy.owner_port(k.notice_channel(GATEWAY)) for k in queue.shard_keys()]
    victim = owner[0]
    dead = [i for i in range(SHARDS) if owner[i] == victim]
    router = ReplyRouter(pubsub, client, queue.producer.reply_key,
                         [k.notice_channel(GATEWAY) for k in queue.shard_keys()],
                         poll_after_s=3600, shard_of=queue.producer.shard_of_request)
    served = ServedModel(info, tokenizer, queue, router, GatewayConfig(), GATEWAY)
    calls: list[asyncio.Task] = []

    def call_on(shard: int, text: str) -> asyncio.Task:
        queue.producer.loads.pick = lambda: shard
        calls.append(asyncio.create_task(served.embed(EmbedInput(texts=[text]), Timer(60))))
        return calls[-1]

    async def queued_on(shard: int) -> bool:
        return (await queue.shard(shard).stats()).queued_entries > 0

    await router.start()
    try:
        await asyncio.wait_for(router.subscribed.wait(), 20)
        waiting = [call_on(shard, f"waiting on shard {shard}") for shard in dead[:1]]
        await wait_for(lambda: queued_on(dead[0]), 20, "the call's entry")
        await asyncio.to_thread(healthy.kill, victim)
        start = time.monotonic()
        with pytest.raises(Unavailable):
            await asyncio.wait_for(waiting[0], 10)
        assert time.monotonic() - start < 2  # the failover itself takes ~3-5 s

        async def served_again() -> bool:
            return healthy.owner_port(queue.shard_keys()[dead[0]].notice_channel(GATEWAY)) != victim
        await wait_for(served_again, 30, "the replica to take over")

        async def resubscribed() -> bool:
            return router.subscribed.is_set()
        await wait_for(resubscribed, 10, "the router to subscribe on the new primary")
        # The first call's entry may be there still (its cancel met the dead node).
        before = (await queue.shard(dead[0]).stats()).queued_entries
        call = call_on(dead[0], "after the failover")

        async def queued_again() -> bool:
            return (await queue.shard(dead[0]).stats()).queued_entries > before
        await wait_for(queued_again, 20, "the new call's entry")
        await _answer_shard(queue, dead[0])
        out = await asyncio.wait_for(call, 10)
        assert [v.tolist() for v in out.vectors] == [[1.0] * 4]
    finally:
        for task in calls:
            task.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        await router.stop()
        await close_client(client)
        await close_client(pubsub)


async def test_a_dead_node_fails_only_the_calls_on_its_shards(healthy, info, tokenizer):
    client, pubsub = connect(healthy.url), connect_pubsub(healthy.url)
    queue = ShardedQueue(client, "node-down", QueueConfig(queue_shards=SHARDS))
    owner = [healthy.owner_port(k.notice_channel(GATEWAY)) for k in queue.shard_keys()]
    victim = owner[0]
    dead = [i for i in range(SHARDS) if owner[i] == victim]
    alive = [i for i in range(SHARDS) if owner[i] != victim]
    assert alive, owner
    router = ReplyRouter(pubsub, client, queue.producer.reply_key,
                         [k.notice_channel(GATEWAY) for k in queue.shard_keys()],
                         poll_after_s=3600, shard_of=queue.producer.shard_of_request)
    served = ServedModel(info, tokenizer, queue, router, GatewayConfig(), GATEWAY)
    calls: dict[int, asyncio.Task] = {}

    def call_on(shard: int, text: str) -> asyncio.Task:
        queue.producer.loads.pick = lambda: shard  # this call's shard
        task = asyncio.create_task(served.embed(EmbedInput(texts=[text]), Timer(60)))
        return task

    async def queued_on(shard: int) -> bool:
        return (await queue.shard(shard).stats()).queued_entries > 0

    await router.start()
    try:
        await asyncio.wait_for(router.subscribed.wait(), 20)
        for shard in range(SHARDS):  # one call waiting on every shard
            calls[shard] = call_on(shard, f"waiting on shard {shard}")
            await wait_for(lambda: queued_on(shard), 20, f"shard {shard}'s entry")
            assert not calls[shard].done()

        await asyncio.to_thread(_kill_pair, healthy, victim)
        start = time.monotonic()
        for shard in dead:  # answered UNAVAILABLE at once, not at their deadline (60 s)
            with pytest.raises(Unavailable, match="lost the connection to Redis"):
                await asyncio.wait_for(calls[shard], 10)
        assert time.monotonic() - start < 3
        assert not any(calls[s].done() for s in alive)  # still waiting: their nodes are fine
        start = time.monotonic()  # a new call that lands on the dead node: UNAVAILABLE too
        with pytest.raises(Exception) as refused:
            await asyncio.wait_for(call_on(dead[0], "new, on the dead node"), 20)
        assert code_of(refused.value) == grpc.StatusCode.UNAVAILABLE, refused.value
        assert time.monotonic() - start < 5

        for shard in alive:  # answered by their notices (the poll is an hour away)
            assert await _answer_shard(queue, shard) == 1
            out = await asyncio.wait_for(calls[shard], 10)
            assert [v.tolist() for v in out.vectors] == [[1.0] * 4]
        for shard in alive:  # and new calls on them too
            call = call_on(shard, f"after the node died, on shard {shard}")
            await wait_for(lambda: queued_on(shard), 20, f"shard {shard}'s new entry")
            await _answer_shard(queue, shard)
            out = await asyncio.wait_for(call, 10)
            assert [v.tolist() for v in out.vectors] == [[1.0] * 4]

        # Left to pick shards itself, the gateway sends new calls to live shards: a dead one is
        # left out once a load read or an enqueue failed to reach it (it was picked as often
        # as any other: its last read load stayed low).
        del queue.producer.loads.pick
        refused = 0
        for i in range(24):
            before = sum([(await queue.shard(s).stats()).queued_entries for s in alive])
            task = asyncio.create_task(served.embed(EmbedInput(texts=[f"picked {i}"]), Timer(60)))
            calls[100 + i] = task

            async def settled() -> bool:
                return task.done() or sum([(await queue.shard(s).stats()).queued_entries
                                           for s in alive]) > before
            await wait_for(settled, 20, f"call {i} queued or refused")
            refused += task.done()
        assert refused <= 1, f"{refused} of 24 new calls went to the dead shards {dead} of {SHARDS}"
        for task in list(calls.values()):
            task.cancel()
        await asyncio.gather(*calls.values(), return_exceptions=True)
        for shard in alive:
            await _answer_shard(queue, shard)  # the cancelled calls' entries, if any are left

        # The stats sum the shards that answer, and name the others.
        leftover = call_on(alive[0], "left queued")
        await wait_for(lambda: queued_on(alive[0]), 20, "an entry queued on a live shard")
        stats = await queue.stats.read()
        assert stats.unreadable_shards == tuple(dead) and stats.num_shards == SHARDS
        assert stats.queued_entries == 1
        assert stats.counters["enqueued"] >= len(alive) * 2 + 1
        leftover.cancel()
        await asyncio.gather(leftover, return_exceptions=True)
    finally:
        for task in calls.values():
            task.cancel()
        await asyncio.gather(*calls.values(), return_exceptions=True)
        await router.stop()
        await close_client(client)
        await close_client(pubsub)  # (the next test's fixture starts the dead nodes again)


@pytest.fixture
def pair_down(cluster):
    """A primary and its replica not running, their slots served by nobody: left so by the test
    before, else killed here. The dead ports."""
    primaries = set(cluster.primary_ports())  # the slot map still names a dead primary
    dead = {n.port for n in cluster.nodes if not n.running}
    if not dead & primaries:
        for port in dead:
            cluster.restart(port)
        dead = set(_kill_pair(cluster, sorted(primaries)[0]))
    return dead


@pytest.fixture(scope="module")
def engine():
    from tokq.workers.engine import Engine

    return Engine.load(None, device="cpu")


def _queue_name_with_a_dead_shard(cluster: LocalCluster, dead: set[int], shard0_dead: bool = False) -> str:
    """A queue whose shard 0 (the model-wide keys: heartbeats, budget) is on a live node, or
    with ``shard0_dead`` on the dead one, and at least one other shard on each."""
    for attempt in range(100):
        name = f"worker-node-down-{attempt}"
        owners = [cluster.owner_port(QueueKeys(shard_queue_name(name, i)).work_channel)
                  for i in range(SHARDS)]
        if (owners[0] in dead) == shard0_dead and any(o in dead for o in owners[1:]) \
                and not all(o in dead for o in owners[1:]):
            return name
    raise AssertionError("no queue name spreads its shards as needed")


@pytest.mark.parametrize("shard0_dead", [False, True], ids=["shard 0 live", "shard 0 dead"])
async def test_a_worker_hears_the_live_shards_notices_while_a_node_is_down(cluster, pair_down, engine,
                                                                         shard0_dead):
    """With shard 0's node out too (the shard count, budget and heartbeats live there), the
    worker starts all the same (it ended at its first read of the shard count) and serves the
    shards that answer."""
    from queue_support import answered_vectors, enqueue_ids

    from tokq.config import WorkerConfig
    from tokq.workers.worker import Worker

    name = _queue_name_with_a_dead_shard(cluster, pair_down, shard0_dead)
    config = QueueConfig(queue_shards=SHARDS)
    owners = [cluster.owner_port(QueueKeys(shard_queue_name(name, i)).work_channel)
              for i in range(SHARDS)]
    live = [i for i in range(SHARDS) if owners[i] not in pair_down]
    url = cluster.node_url(next(n.port for n in cluster.nodes if n.running))  # not a dead one
    client, worker_client = connect(url), connect(url)
    queue, worker_queue = ShardedQueue(client, name, config), ShardedQueue(worker_client, name, config)
    exits: list[int] = []
    worker = Worker(engine, worker_queue, WorkerConfig(token_budget=512), config,
                    worker_id="node-down", exit_process=exits.append)
    run = asyncio.create_task(worker.run())
    try:
        async def idle_on_live_shards() -> bool:
            return all([await client.sismember(queue.shard(i).keys.idle,
                                               worker_queue.shard(i).batch_prefix) for i in live])
        await wait_for(idle_on_live_shards, 60, "the worker to register idle on the live shards")
        for n, shard in enumerate(live[:3]):
            heard = worker.wake.idle.wakeups
            await enqueue_ids(queue.shard(shard), f"r{n}", [np.array([101, 7592, 102])])
            got = await answered_vectors(queue.shard(shard), f"r{n}", 1)
            assert got.shape == (1, engine.info.hidden_size)
            assert worker.wake.idle.wakeups > heard, f"no work wake-up heard from shard {shard}"
            await wait_for(idle_on_live_shards, 20, "the worker to wait for work again")
    finally:
        worker.stop()
        await asyncio.wait_for(run, 30)
        await close_client(client)
        await close_client(worker_client)
    assert exits == []


async def test_a_node_that_stops_answering_is_left_out_of_the_picks_within_a_second(healthy):
    """A node paused (SIGSTOP: no reset, its connections just go quiet) held every shard's load
    read for the cluster client's retries of the 5 s socket timeout, so no shard's flag moved;
    each read is now bounded."""
    import signal

    client = connect(healthy.url)
    queue = ShardedQueue(client, "node-paused", QueueConfig(queue_shards=SHARDS))
    owners = [healthy.owner_port(k.tokens) for k in queue.shard_keys()]
    victim = owners[0]
    node = next(n for n in healthy.nodes if n.port == victim)
    try:
        await queue.producer.loads.refresh()
        assert not any(queue.producer.loads.unreachable)
        os.kill(node.proc.pid, signal.SIGSTOP)
        start = time.monotonic()
        await asyncio.wait_for(queue.producer.loads.refresh(), 5)
        assert time.monotonic() - start < 2
        assert queue.producer.loads.unreachable == [owner == victim for owner in owners]
        assert queue.producer.loads.pick() != 0
    finally:
        os.kill(node.proc.pid, signal.SIGCONT)
        await close_client(client)


async def test_a_worker_logs_a_shard_it_cannot_requeue_once_per_outage(cluster, pair_down, engine, caplog):
    """Every half lease the worker redoes expired leases on every shard: with one shard's node
    out each check failed and was logged (here every 0.1 s); now once for the outage."""
    import logging

    from tokq.config import WorkerConfig
    from tokq.workers.worker import Worker

    caplog.set_level(logging.WARNING, logger="tokq.worker")
    name = _queue_name_with_a_dead_shard(cluster, pair_down)
    config = QueueConfig(queue_shards=SHARDS, lease_ms=200)
    url = cluster.node_url(next(n.port for n in cluster.nodes if n.running))
    client = connect(url)
    worker = Worker(engine, ShardedQueue(client, name, config), WorkerConfig(token_budget=512), config,
                    worker_id="requeue-down", exit_process=lambda code: None)
    run = asyncio.create_task(worker.run())
    try:
        await asyncio.sleep(3)  # ~30 checks
    finally:
        worker.stop()
        await asyncio.wait_for(run, 30)
        await close_client(client)
    failed = [r for r in caplog.records if "requeue_expired failed" in r.getMessage()]
    assert len(failed) == 1, len(failed)
