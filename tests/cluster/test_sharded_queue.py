"""A model's queue as S shards (tokq.queue.sharded), on a standalone server and on a real cluster."""

from __future__ import annotations

import contextlib
import random

import pytest
from queue_support import QUEUE, items, ok_result

from tokq.config import QueueConfig
from tokq.redis.connection import connect
from tokq.queue.keys import QueueKeys, shard_queue_name
from tokq.queue.sharded import ShardedQueue

pytestmark = pytest.mark.redis_kinds("standalone", "cluster")
GW = "gw-test"


@contextlib.asynccontextmanager
async def open_sharded(url: str, num_shards: int, seed: int = 1, **config):
    client = connect(url)
    q = ShardedQueue(client, QUEUE, QueueConfig(queue_shards=num_shards, **config),
                     rng=random.Random(seed))
    try:
        yield q
    finally:
        await q.close()
        await client.aclose()


async def _drain(q: ShardedQueue, token_budget: int = 64) -> list:
    claims = []
    while (claim := await q.consumer.claim(token_budget)) is not None:
        claims.append(claim)
        await q.consumer.ack(claim.batch_id, [(e, ok_result(e)) for e in claim.entries])
    return claims


def test_shard_zero_is_the_unsharded_queue_and_others_have_their_own_tag():
    assert shard_queue_name("m", 0) == "m"
    assert QueueKeys(shard_queue_name("m", 3)).pending == "tokq:{m#3}:pending"
    with pytest.raises(ValueError):
        QueueKeys("m#0")  # not a name a model or a shard can have


def test_shards_spread_over_the_cluster_nodes(redis_cluster):
    owners = {redis_cluster.owner_port(QueueKeys(shard_queue_name(QUEUE, s)).pending)
              for s in range(8)}
    assert len(owners) == 3


async def test_each_request_stays_whole_on_one_shard_and_all_are_claimed_once(redis_url):
    async with open_sharded(redis_url, 4) as q:
        for r in range(40):
            await q.producer.enqueue(f"r{r}", items(*([3] * (1 + r % 4))), timeout_ms=60_000, gateway_id=GW)
        used = {q.producer.shard_of_request(f"r{r}") for r in range(40)}
        assert used == {0, 1, 2, 3}  # two random choices reached every shard
        stats = await q.stats.read()
        assert stats.queued_entries == sum(1 + r % 4 for r in range(40))
        claims = await _drain(q)
        seen = [(e.request_id, e.index) for c in claims for e in c.entries]
        assert len(seen) == len(set(seen)) == stats.queued_entries
        for c in claims:  # a batch is one shard's: its requests were all enqueued there
            shard = ShardedQueue.shard_of_batch(c.batch_id)
            assert {q.producer.shard_of_request(e.request_id) for e in c.entries} == {shard}
        for r in range(40):
            assert sorted(await q.producer.collect(f"r{r}")) == list(range(1 + r % 4))
        assert (await q.stats.read()).queued_entries == 0


async def test_the_less_loaded_of_two_shards_gets_the_next_request(redis_url):
    async with open_sharded(redis_url, 2) as q:
        await q.producer.enqueue("big", items(500), timeout_ms=60_000, gateway_id=GW)
        big = q.producer.shard_of_request("big")
        for r in range(5):
            await q.producer.enqueue(f"small{r}", items(10), timeout_ms=60_000, gateway_id=GW)
            assert q.producer.shard_of_request(f"small{r}") == 1 - big


async def test_a_busy_shard_does_not_starve_the_others(redis_url):
    async with open_sharded(redis_url, 3) as q:
        busy, quiet = q.shard(0), q.shard(2)
        for r in range(30):
            await busy.enqueue(f"b{r}", items(8), timeout_ms=60_000,
                               notice_channel=busy.keys.notice_channel(GW))
        await quiet.enqueue("q0", items(8), timeout_ms=60_000, notice_channel=quiet.keys.notice_channel(GW))
        served = []
        for _ in range(3):  # within S claims every non-empty shard is served
            claim = await q.consumer.claim(8)
            served.append(ShardedQueue.shard_of_batch(claim.batch_id))
        assert 2 in served and 0 in served


async def test_ack_and_renew_go_to_the_batch_shard(redis_url):
    async with open_sharded(redis_url, 4, lease_ms=5_000) as q:
        for r in range(8):
            await q.producer.enqueue(f"r{r}", items(4), timeout_ms=60_000, gateway_id=GW)
        claims = []
        while (c := await q.consumer.claim(4)) is not None:
            claims.append(c)
        assert {ShardedQueue.shard_of_batch(c.batch_id) for c in claims} == {
            q.producer.shard_of_request(f"r{r}") for r in range(8)}
        for c in claims:
            assert await q.consumer.renew(c.batch_id)
            await q.consumer.ack(c.batch_id, [(e, ok_result(e)) for e in c.entries])
            assert not await q.consumer.renew(c.batch_id)  # acknowledged: its lease is gone
        assert (await q.stats.read()).inflight_batches == 0
        for r in range(8):
            assert list(await q.producer.collect(f"r{r}")) == [0]


async def test_cancel_reaches_the_request_shard(redis_url):
    async with open_sharded(redis_url, 4) as q:
        await q.producer.enqueue("r1", items(4), timeout_ms=60_000, gateway_id=GW)
        shard = q.shard(q.producer.shard_of_request("r1"))
        assert await q.producer.cancel("r1")
        assert not await q.redis.exists(shard.keys.reply("r1"))
        assert await q.consumer.claim(100) is None  # the orphaned entry is dropped, never claimed


async def test_a_rejected_request_leaves_nothing_behind_in_the_gateway(redis_url):
    # Its shard was kept for good (the gateway neither collects nor cancels a rejected
    # request): one dict entry per 429 under a sustained overload.
    from tokq.queue.shard import QueueFull

    async with open_sharded(redis_url, 1, max_queued_tokens=10) as q:
        await q.producer.enqueue("first", items(20), timeout_ms=60_000, gateway_id=GW)  # an empty queue takes one
        for i in range(3):
            with pytest.raises(QueueFull):
                await q.producer.enqueue(f"big{i}", items(20), timeout_ms=60_000, gateway_id=GW)
            assert q.producer.shard_of_request(f"big{i}") is None


async def test_raising_the_shard_count_live_loses_nothing(redis_url):
    """Gateways move from 2 to 4 shards while old workers (configured for 1) still run."""
    async with open_sharded(redis_url, 2) as gw2, open_sharded(redis_url, 4, seed=2) as gw4, \
            open_sharded(redis_url, 1, seed=3) as worker:
        for r in range(10):
            await gw2.producer.enqueue(f"a{r}", items(5), timeout_ms=60_000, gateway_id=GW)
        await gw4.record_shard_count()  # a gateway with 4 shards starts
        for r in range(20):
            await gw4.producer.enqueue(f"b{r}", items(5), timeout_ms=60_000, gateway_id=GW)
        assert {gw4.producer.shard_of_request(f"b{r}") for r in range(20)} & {2, 3}
        assert await worker.refresh_shard_count() == 4
        claims = await _drain(worker)
        assert sum(len(c.entries) for c in claims) == 30
        for r in range(10):
            assert list(await gw2.producer.collect(f"a{r}")) == [0]
        for r in range(20):
            assert list(await gw4.producer.collect(f"b{r}")) == [0]


async def test_lowering_the_shard_count_keeps_draining_the_retired_shards(redis_url):
    async with open_sharded(redis_url, 4) as gw4, open_sharded(redis_url, 1, seed=3) as worker:
        await gw4.record_shard_count()
        for r in range(12):
            await gw4.producer.enqueue(f"r{r}", items(5), timeout_ms=60_000, gateway_id=GW)
        # every gateway restarts with 1 shard: workers still drain shards 1..3
        async with open_sharded(redis_url, 1) as gw1:
            await gw1.record_shard_count()
        assert await worker.refresh_shard_count() == 4
        assert sum(len(c.entries) for c in await _drain(worker)) == 12


async def test_a_worker_in_a_heavy_forward_hears_light_work_on_any_shard_and_claims_it_alone(redis_url):
    from tokq.redis.pubsub import ShardedSubscriber

    async with open_sharded(redis_url, 3) as worker, open_sharded(redis_url, 3, seed=2) as gateway:
        sub = ShardedSubscriber(worker.redis)
        await sub.subscribe(*worker.consumer.worker_channels())
        await worker.consumer.mark_preemptible(True)  # on every shard it claims from
        for r in range(6):  # heavy requests on every shard, light ones after them
            await gateway.producer.enqueue(f"h{r}", items(100, 100), timeout_ms=60_000, gateway_id=GW)
        for r in range(6):
            await gateway.producer.enqueue(f"l{r}", items(5), timeout_ms=60_000, gateway_id=GW)
        light_shards = {gateway.producer.shard_of_request(f"l{r}") for r in range(6)}
        heard = []
        while (msg := await sub.get_message(timeout=0.3)) is not None:
            heard.append(msg)
        # One 'light' per shard whose light lane filled, each on that shard's worker channel.
        assert sorted(channel for channel, _ in heard) == sorted(
            worker.shard(s).worker_channel.encode() for s in light_shards)
        assert {data for _, data in heard} == {b"light"}
        taken = []
        while (claim := await worker.consumer.claim(128, lanes="light")) is not None:
            taken += [e.request_id for e in claim.entries]
            await worker.consumer.ack(claim.batch_id, [(e, ok_result(e)) for e in claim.entries])
        assert sorted(taken) == [f"l{r}" for r in range(6)]  # every light request, no heavy one
        assert (await worker.stats.read()).queued_entries == 12
        await sub.aclose()
