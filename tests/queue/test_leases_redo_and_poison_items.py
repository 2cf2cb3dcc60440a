"""Leases: renewal, a crashed worker's batch redone in batches, poison items isolated and
stopped, acks idempotent."""

from __future__ import annotations

import asyncio

import pytest
from queue_support import NOTICE_CHANNEL, ManualClock, items, keys_left, ok_result, open_queue

from tokq.queue.wire import decode_result, encode_error
from tokq.queue.shard import parse_notices
from tokq.redis.pubsub import ShardedSubscriber

# The same queue code against a standalone server and a node of a real Redis Cluster.
pytestmark = pytest.mark.redis_kinds("standalone", "cluster")


async def test_crashed_worker_batch_is_redone_and_seen_once(redis_url):
    clock = ManualClock()
    async with open_queue(redis_url, clock, lease_ms=1_000) as q:
        pubsub = ShardedSubscriber(q.redis)
        await pubsub.subscribe(NOTICE_CHANNEL)  # confirmed when it returns
        stalled = ShardedSubscriber(q.redis)
        await stalled.subscribe(q.worker_channel)  # its process lives on: redone at expiry
        await q.enqueue("r", items(5, 5, 5), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        crashed = await q.claim(10)  # items 0 and 1; this worker never acks
        await q.enqueue("later", items(5), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        clock.advance(999)
        assert await q.requeue_expired() == (0, 0)
        clock.advance(1)
        assert await q.requeue_expired() == (2, 0)

        # Back at the front of the heavy lane, in order, ahead of everything queued since, in a
        # normal batch (behind the light lane's share: item 2, still queued there).
        for expected in ([("r", 2, 0), ("r", 0, 1), ("r", 1, 1)], [("later", 0, 0)]):
            redo = await q.claim(15)
            assert [(e.request_id, e.index, e.attempt) for e in redo.entries] == expected
            await q.ack(redo.batch_id, [(e, ok_result(e)) for e in redo.entries])
        # The crashed worker wakes up and acks late: nothing it sends is seen.
        await q.ack(crashed.batch_id, [(e, encode_error("INTERNAL", "stale")) for e in crashed.entries])

        published = []
        while (message := await pubsub.get_message(timeout=0.2)):
            published += [rid for rid, _ in parse_notices(message[1])]
        assert published == ["r", "later"]  # each request's completion, once
        await stalled.aclose()
        results = await q.collect("r")
        assert [decode_result(results[i]).vector.tolist() for i in range(3)] == [
            [0.0, 1.0], [1.0, 1.0], [2.0, 0.0]]
        stats = await q.stats()
        assert (stats.inflight_items, stats.inflight_batches, stats.queued_entries) == (0, 0, 0)
        assert stats.counters["requeued"] == 2 and stats.counters["acked"] == 4
        await pubsub.aclose()


async def test_late_ack_before_the_redo_answers_once(redis_url):
    clock = ManualClock()
    async with open_queue(redis_url, clock, lease_ms=1_000) as q:
        await q.enqueue("r", items(5, 5), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        slow = await q.claim(600)
        clock.advance(1_000)
        await q.requeue_expired()
        # The slow worker finishes after its items were requeued: its results are valid.
        await q.ack(slow.batch_id, [(e, ok_result(e)) for e in slow.entries])
        redo = await q.claim(600)  # redone once: together again
        assert len(redo.entries) == 2
        await q.ack(redo.batch_id, [(e, ok_result(e)) for e in redo.entries])
        results = await q.collect("r")
        assert [decode_result(results[i]).vector.tolist() for i in range(2)] == [[0.0, 0.0], [1.0, 0.0]]
        stats = await q.stats()
        assert (stats.inflight_items, stats.counters["acked"]) == (0, 2)
        assert await keys_left(q) == set()


async def test_poison_items_stop_after_max_attempts(redis_url):
    clock = ManualClock()
    async with open_queue(redis_url, clock, lease_ms=1_000, max_attempts=3) as q:
        await q.enqueue("poison", items(5, 5), timeout_ms=600_000, notice_channel=NOTICE_CHANNEL)
        outcomes = []
        for _ in range(10):
            claim = await q.claim(600)
            if claim is None:
                break
            clock.advance(1_000)
            outcomes.append(await q.requeue_expired())
        # Together twice (a crash is usually the worker's, not the items'); after the second
        # crash each is redone alone, and its attempts run out.
        assert outcomes == [(2, 0), (2, 0), (0, 1), (0, 1)]
        results = {i: decode_result(r) for i, r in (await q.collect("poison")).items()}
        assert {r.code for r in results.values()} == {"INTERNAL"}
        assert "failed 3 times" in results[0].message
        assert await keys_left(q) == set()
        assert (await q.stats()).counters["failed"] == 2


async def test_renewed_lease_is_not_requeued(redis_url):
    clock = ManualClock()
    async with open_queue(redis_url, clock, lease_ms=1_000) as q:
        await q.enqueue("r", items(5), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        claim = await q.claim(600)
        for _ in range(3):
            clock.advance(800)
            assert await q.renew(claim.batch_id)
            assert await q.requeue_expired() == (0, 0)
        await q.ack(claim.batch_id, [(e, ok_result(e)) for e in claim.entries])
        assert not await q.renew(claim.batch_id)


async def test_requeue_says_when_the_next_lease_expires_or_is_due_a_check(redis_url):
    """Workers call requeue again at the next lease event: half a lease before a deadline (a
    lease that missed a renewal is checked for a live owner), or the deadline itself."""
    clock = ManualClock()
    async with open_queue(redis_url, clock, lease_ms=1_000) as q:
        owner = ShardedSubscriber(q.redis)
        await owner.subscribe(q.worker_channel)  # alive: leases go only at their deadline
        assert await q.requeue_expired() == (0, 0)
        assert q.next_expiry_ms is None  # no lease: the half-lease poll
        await q.enqueue("r", items(5, 5), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        first = await q.claim(5)  # due at 1_000
        clock.advance(300)
        await q.claim(5)  # due at 1_300
        await q.requeue_expired()
        assert q.next_expiry_ms == 200  # the first lease is due a check at 500
        clock.advance(300)
        assert await q.requeue_expired() == (0, 0)  # checked: its owner lives
        assert q.next_expiry_ms == 200  # the second's check (800) before the first's end (1_000)
        await q.renew(first.batch_id)  # now due at 1_600
        clock.advance(700)
        assert await q.requeue_expired() == (1, 0)  # the second expired
        assert q.next_expiry_ms == 300  # the first is due a check at 1_100
        await owner.aclose()


async def test_a_lease_that_missed_a_renewal_is_redone_at_once_when_its_owner_is_gone(redis_url):
    """A worker killed -9 loses its connection, and with it its worker-channel subscription:
    half a lease after its last renewal its batch is redone, without waiting for the deadline.
    While the owner's subscription lives, the same lease waits for its deadline."""
    clock = ManualClock()
    async with open_queue(redis_url, clock, lease_ms=1_000) as q:
        owner = ShardedSubscriber(q.redis)
        await owner.subscribe(q.worker_channel)
        await q.enqueue("r", items(5), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        await q.claim(5)
        clock.advance(499)
        assert await q.requeue_expired() == (0, 0)  # renewed on time would be at 333: not due
        clock.advance(1)
        assert await q.requeue_expired() == (0, 0)  # due a check, but its owner lives
        await owner.aclose()  # the process dies (Redis sees its connection close soon after)
        for _ in range(200):
            if (done := await q.requeue_expired()) != (0, 0):
                break
            await asyncio.sleep(0.01)
        assert done == (1, 0)  # redone half a lease early
        redo = await q.claim(5)
        assert [(e.request_id, e.attempt) for e in redo.entries] == [("r", 1)]


async def test_ack_is_idempotent(redis_url):
    async with open_queue(redis_url) as q:
        await q.enqueue("r", items(5, 6), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        claim = await q.claim(600)
        for _ in range(2):
            await q.ack(claim.batch_id, [(e, ok_result(e)) for e in claim.entries])
        stats = await q.stats()
        assert (stats.inflight_items, stats.counters["acked"]) == (0, 2)
        assert len(await q.collect("r")) == 2


async def test_worker_can_ack_an_item_with_an_error(redis_url):
    async with open_queue(redis_url) as q:
        await q.enqueue("r", items(5, 6), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        claim = await q.claim(600)
        first, second = claim.entries
        await q.ack(claim.batch_id, [(first, ok_result(first)),
                                     (second, encode_error("INVALID_ARGUMENT", "too long"))])
        results = await q.collect("r")
        assert decode_result(results[0]).ok
        assert (decode_result(results[1]).code, decode_result(results[1]).message) == (
            "INVALID_ARGUMENT", "too long")


async def test_an_ack_counts_embeddings_as_acked_and_every_error_answer_as_failed(redis_url):
    """acked: items answered with an embedding; failed: with an error, the worker's own error
    results included (they were counted as acked), and items it left out."""
    async with open_queue(redis_url) as q:
        await q.enqueue("r", items(5, 6, 7), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        claim = await q.claim(600)
        refused, good, _left_out = claim.entries
        sent = [(refused, encode_error("INVALID_ARGUMENT", "token id 40000 is out of range")),
                (good, ok_result(good))]
        for _ in range(2):  # repeated (its answer lost): the stored results are not counted again
            await q.ack(claim.batch_id, sent)
            counters = (await q.stats()).counters
            assert (counters["acked"], counters["failed"]) == (1, 2)
        results = {i: decode_result(r) for i, r in (await q.collect("r")).items()}
        assert [results[i].code for i in range(3)] == ["INVALID_ARGUMENT", "", "INTERNAL"]


async def test_a_late_error_ack_after_the_redo_counts_nothing(redis_url):
    clock = ManualClock()
    async with open_queue(redis_url, clock, lease_ms=1_000) as q:
        await q.enqueue("r", items(5, 5), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        slow = await q.claim(600)
        clock.advance(1_000)
        assert await q.requeue_expired() == (2, 0)
        redo = await q.claim(600)
        await q.ack(redo.batch_id, [(e, ok_result(e)) for e in redo.entries])
        await q.ack(slow.batch_id, [(e, encode_error("INTERNAL", "stale")) for e in slow.entries])
        counters = (await q.stats()).counters
        assert (counters["acked"], counters.get("failed", 0)) == (2, 0)


async def test_an_item_answered_by_a_late_ack_is_not_failed_when_its_redo_runs_out(redis_url):
    """Its slow first worker answered it after the lease was requeued; the redo's worker then
    crashed on its last attempt: its answer stays the embedding, and it is not counted failed."""
    clock = ManualClock()
    async with open_queue(redis_url, clock, lease_ms=1_000, max_attempts=2) as q:
        await q.enqueue("r", items(5), timeout_ms=600_000, notice_channel=NOTICE_CHANNEL)
        slow = await q.claim(600)
        clock.advance(1_000)
        assert await q.requeue_expired() == (1, 0)
        await q.ack(slow.batch_id, [(e, ok_result(e)) for e in slow.entries])  # late, stored
        assert (await q.claim(600)).entries[0].attempt == 1  # the redo; its worker crashes
        clock.advance(1_000)
        assert await q.requeue_expired() == (0, 0)  # out of attempts, but already answered
        assert decode_result((await q.collect("r"))[0]).ok
        counters = (await q.stats()).counters
        assert (counters["acked"], counters.get("failed", 0)) == (1, 0)


async def test_items_left_out_of_an_ack_are_answered_with_an_error(redis_url):
    async with open_queue(redis_url) as q:
        await q.enqueue("r", items(5, 6, 7), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        claim = await q.claim(600)
        await q.ack(claim.batch_id, [(claim.entries[1], ok_result(claim.entries[1]))])
        results = {i: decode_result(r) for i, r in (await q.collect("r")).items()}
        assert results[1].ok
        assert (results[0].code, results[2].code) == ("INTERNAL", "INTERNAL")
        stats = await q.stats()
        assert (stats.inflight_items, stats.counters["failed"]) == (0, 2)


@pytest.mark.parametrize("max_attempts", [2, 3, 5])
async def test_poison_item_does_not_use_up_its_batch_mates_attempts(redis_url, max_attempts):
    clock = ManualClock()
    async with open_queue(redis_url, clock, lease_ms=1_000, max_attempts=max_attempts) as q:
        await q.enqueue("r", items(5, 5, 5), timeout_ms=600_000, notice_channel=NOTICE_CHANNEL)
        for _ in range(20):
            claim = await q.claim(600)
            if claim is None:
                break
            if any(e.index == 1 for e in claim.entries):  # item 1 crashes every worker
                clock.advance(1_000)
                await q.requeue_expired()
            else:
                await q.ack(claim.batch_id, [(e, ok_result(e)) for e in claim.entries])
        results = {i: decode_result(r) for i, r in (await q.collect("r")).items()}
        assert [results[i].ok for i in range(3)] == [True, False, True]
        assert results[1].code == "INTERNAL"
        assert f"failed {max_attempts} times" in results[1].message


async def test_a_crashed_workers_many_items_come_back_in_full_batches(redis_url):
    """No storm: the hundreds of short items a dead worker held are redone in budget-sized
    batches, not one forward each."""
    clock = ManualClock()
    async with open_queue(redis_url, clock, lease_ms=1_000) as q:
        await q.enqueue("r", items(*[4] * 300), timeout_ms=600_000, notice_channel=NOTICE_CHANNEL)
        held = [await q.claim(400), await q.claim(400)]  # a batch and its prefetch: 200 items
        clock.advance(1_000)
        assert await q.requeue_expired() == (200, 0)
        redo = [await q.claim(400) for _ in range(2)]
        assert [len(c.entries) for c in held] == [len(c.entries) for c in redo] == [100, 100]
        assert {e.attempt for c in redo for e in c.entries} == {1}
