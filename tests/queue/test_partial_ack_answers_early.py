"""ack.lua's partial mode: a worker answers a claim's interactive items before the batch-class
part's forward (workers/loop.py). A partial ack stores its results and sends their notices but
keeps the lease; the final ack releases it. Every item is answered once, and counted once."""

from __future__ import annotations

import numpy as np
import pytest
from queue_support import NOTICE_CHANNEL, ManualClock, items, keys_left, ok_result, open_queue

from tokq.queue.shard import parse_notices
from tokq.queue.wire import decode_result, encode_ok
from tokq.redis.pubsub import ShardedSubscriber

pytestmark = pytest.mark.redis_kinds("standalone", "cluster")


async def _claim_beside_bulk(q):
    """Two interactive requests (q1: one item, q2: two) and a batch-class one (b: two items),
    all in one claim, batch-class entries last."""
    await q.enqueue("q1", items(3), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
    await q.enqueue("q2", items(2, 2), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
    await q.enqueue("b", items(4, 4), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL, priority="batch")
    claim = await q.claim(600)
    assert [e.request_id for e in claim.entries] == ["q1", "q2", "q2", "b", "b"]
    assert claim.num_batch == 2
    return claim


async def _notified(pubsub) -> list[str]:
    """The request ids of every notice published so far (each message read until none is left)."""
    ids = []
    while (message := await pubsub.get_message(timeout=0.3)) is not None:
        ids += [request_id for request_id, _ in parse_notices(message[1])]
    return ids


async def _leased(q, batch_id: str) -> bool:
    return (await q.redis.zscore(q.keys.leases, batch_id) is not None
            and await q.redis.exists(q.keys.lease(batch_id)) == 1)


@pytest.mark.parametrize("final_results", ["all", "rest"])
async def test_a_partial_ack_answers_early_and_the_final_ack_releases_the_lease(redis_url, final_results):
    async with open_queue(redis_url) as q:
        pubsub = ShardedSubscriber(q.redis)
        await pubsub.subscribe(NOTICE_CHANNEL)
        claim = await _claim_beside_bulk(q)
        early = [(e, ok_result(e)) for e in claim.entries[:3]]
        for _ in range(2):  # a repeat (a lost answer) stores nothing more and sends nothing
            await q.ack(claim.batch_id, early, partial=True)
        assert await _notified(pubsub) == ["q1", "q2"]  # one message for the gateway: both requests
        assert await _leased(q, claim.batch_id)  # the lease is held until the final ack
        stats = await q.stats()
        assert stats.inflight_items == 5
        assert stats.counters.get("acked") == 3 and "failed" not in stats.counters

        # The final ack may carry the early results again: they are neither stored nor counted twice.
        changed = [(e, encode_ok(np.array([9.0, 9.0], np.float32), 1.0, 2.0)) for e in claim.entries[:3]]
        rest = [(e, ok_result(e)) for e in claim.entries[3:]]
        await q.ack(claim.batch_id, (changed if final_results == "all" else []) + rest)
        assert await _notified(pubsub) == ["b"]
        assert not await _leased(q, claim.batch_id)
        stats = await q.stats()
        assert stats.inflight_items == 0
        assert stats.counters.get("acked") == 5 and "failed" not in stats.counters
        for request_id, n in (("q1", 1), ("q2", 2), ("b", 2)):
            results = await q.collect(request_id)
            assert sorted(results) == list(range(n))
            for index in range(n):
                assert decode_result(results[index]).vector.tolist() == [index, 0.0]
        assert await keys_left(q) == set()
        await pubsub.aclose()


async def test_a_lease_redone_after_a_partial_ack_answers_each_item_once(redis_url):
    """A crash after the partial ack: the lease expires and only its unanswered items are redone,
    in the batch lane still. The early results stand and are not notified or counted twice."""
    clock = ManualClock()
    async with open_queue(redis_url, clock, lease_ms=1_000) as q:
        pubsub = ShardedSubscriber(q.redis)
        await pubsub.subscribe(NOTICE_CHANNEL)
        claim = await _claim_beside_bulk(q)
        await q.ack(claim.batch_id, [(e, ok_result(e)) for e in claim.entries[:3]], partial=True)
        assert await _notified(pubsub) == ["q1", "q2"]
        clock.advance(1_000)
        assert await q.requeue_expired() == (2, 0)
        redo = await q.claim(600)
        assert sorted((e.request_id, e.index) for e in redo.entries) == [("b", 0), ("b", 1)]
        assert {e.attempt for e in redo.entries} == {1} and redo.num_batch == 2
        await q.ack(redo.batch_id, [(e, ok_result(e)) for e in redo.entries])
        assert await _notified(pubsub) == ["b"]  # q1 and q2 are not notified twice
        stats = await q.stats()
        assert stats.inflight_items == 0
        assert stats.counters.get("acked") == 5
        for request_id, n in (("q1", 1), ("q2", 2), ("b", 2)):
            results = await q.collect(request_id)
            attempts = [decode_result(results[i]).vector.tolist()[1] for i in range(n)]
            # the interactive items keep the first attempt's results, b gets the redo's
            assert attempts == [1.0 if request_id == "b" else 0.0] * n
        await pubsub.aclose()
