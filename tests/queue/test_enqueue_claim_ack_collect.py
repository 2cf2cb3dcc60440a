"""enqueue -> claim -> ack -> collect on a real Redis, and what each step leaves behind."""

from __future__ import annotations

import asyncio
from unittest.mock import ANY

import numpy as np
import pytest
from queue_support import (NOTICE_CHANNEL, ManualClock, items, keys_left, ok_result, open_queue,
                           stored_entries)

from tokq.queue.wire import decode_body, decode_result, encode_ok, parse_entry
from tokq.queue.shard import COLLECT_GRACE_MS, MAX_DROPS_PER_CLAIM, QueueFull, parse_notices
from tokq.redis.pubsub import ShardedSubscriber

# The same queue code against a standalone server and a node of a real Redis Cluster.
pytestmark = pytest.mark.redis_kinds("standalone", "cluster")


async def test_full_cycle_leaves_no_key_of_the_request(redis_url):
    async with open_queue(redis_url) as q:
        pubsub = ShardedSubscriber(q.redis)
        await pubsub.subscribe(NOTICE_CHANNEL)  # confirmed when it returns
        req_items = items(3, 5, 2)
        enq = await q.enqueue("req1", req_items, timeout_ms=5_000, notice_channel=NOTICE_CHANNEL)
        claim = await q.claim(600)
        assert [e.index for e in claim.entries] == [0, 1, 2]
        await q.ack(claim.batch_id, [(e, ok_result(e)) for e in claim.entries])

        message = await pubsub.get_message(timeout=1.0)
        [(request_id, delivered)] = parse_notices(message[1])
        assert request_id == "req1"  # the notice carries the results; collect gives the same
        results = await q.collect("req1")
        assert delivered == results and sorted(results) == [0, 1, 2]
        assert decode_result(results[1]).vector.tolist() == [1.0, 0.0]
        assert stored_entries(enq, req_items) == tuple(e.raw for e in claim.entries)
        # Drained: only the monotonically increasing totals and the batch sequence remain.
        assert await keys_left(q) == set()
        assert (await q.stats()).counters == {"enqueued": 3, "claimed": 3, "batches": 1, "acked": 3}
        assert await pubsub.get_message(timeout=0.1) is None
        await pubsub.aclose()


async def test_completion_is_published_once_when_the_last_item_is_answered(redis_url):
    async with open_queue(redis_url) as q:
        pubsub = ShardedSubscriber(q.redis)
        await pubsub.subscribe(NOTICE_CHANNEL)  # confirmed when it returns
        await q.enqueue("req1", items(4, 4), timeout_ms=5_000, notice_channel=NOTICE_CHANNEL)
        claim = await q.claim(4)  # only item 0 fits
        await q.ack(claim.batch_id, [(e, ok_result(e)) for e in claim.entries])
        assert await pubsub.get_message(timeout=0.1) is None
        claim = await q.claim(4)
        await q.ack(claim.batch_id, [(e, ok_result(e)) for e in claim.entries])
        message = await pubsub.get_message(timeout=1.0)
        assert parse_notices(message[1]) == [("req1", ANY)]
        await pubsub.aclose()


async def test_a_complete_reply_travels_in_its_notice_and_is_kept_only_a_grace(redis_url):
    async with open_queue(redis_url) as q:
        pubsub = ShardedSubscriber(q.redis)
        await pubsub.subscribe(NOTICE_CHANNEL)
        await q.enqueue("small", items(3, 4), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        claim = await q.claim(600)
        sent = {e.index: ok_result(e) for e in claim.entries}
        await q.ack(claim.batch_id, [(e, sent[e.index]) for e in claim.entries])
        assert parse_notices((await pubsub.get_message(timeout=1.0))[1]) == [("small", sent)]
        # Nobody needs to collect it: it goes by itself, long before the request's own TTL;
        # a gateway that missed the notice still collects it within that grace.
        assert 0 < await q.redis.pttl(q.keys.reply("small")) <= COLLECT_GRACE_MS
        assert await q.collect("small") == sent
        await pubsub.aclose()


async def test_a_large_reply_is_notified_by_id_and_collected(redis_url):
    async with open_queue(redis_url) as q:
        pubsub = ShardedSubscriber(q.redis)
        await pubsub.subscribe(NOTICE_CHANNEL)
        await q.enqueue("large", items(3, 4), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        claim = await q.claim(600)
        big = encode_ok(np.ones(10_000, np.float32), 1.0, 2.0)  # 2 x 40 kB: past the notice's cap
        await q.ack(claim.batch_id, [(e, big) for e in claim.entries])
        assert parse_notices((await pubsub.get_message(timeout=1.0))[1]) == [("large", None)]
        assert await q.redis.pttl(q.keys.reply("large")) > COLLECT_GRACE_MS  # waits for collect
        assert await q.collect("large") == {0: big, 1: big}
        assert await keys_left(q) == set()
        await pubsub.aclose()


async def test_a_batch_wakes_each_waiting_gateway_once_with_all_its_replies(redis_url):
    other = NOTICE_CHANNEL.replace("gw-test", "gw-other")  # a second gateway on the same queue
    async with open_queue(redis_url) as q:
        pubsub = ShardedSubscriber(q.redis)
        await pubsub.subscribe(NOTICE_CHANNEL, other)
        for rid, channel in (("a", NOTICE_CHANNEL), ("b", other), ("c", NOTICE_CHANNEL), ("d", NOTICE_CHANNEL)):
            await q.enqueue(rid, items(3, 2) if rid == "c" else items(3), timeout_ms=60_000,
                            notice_channel=channel)
        claim = await q.claim(600)
        sent = {(e.request_id, e.index): ok_result(e) for e in claim.entries}
        # "d" is left out of the ack: ack.lua answers it INTERNAL, in the same message.
        await q.ack(claim.batch_id, [(e, sent[e.request_id, e.index]) for e in claim.entries
                                     if e.request_id != "d"])
        messages = []
        while (message := await pubsub.get_message(timeout=0.3)):
            messages.append((message[0].decode(), parse_notices(message[1])))
        assert [(channel, [rid for rid, _ in notices]) for channel, notices in messages] == [
            (NOTICE_CHANNEL, ["a", "c", "d"]), (other, ["b"])]
        delivered = dict(messages[0][1] + messages[1][1])
        for rid in "abc":
            assert delivered[rid] == await q.collect(rid)
            assert delivered[rid] == {i: sent[rid, i] for i in delivered[rid]}
        assert sorted(delivered["c"]) == [0, 1]
        assert decode_result(delivered["d"][0]).code == "INTERNAL"
        await pubsub.aclose()


async def test_one_message_carries_at_most_the_notice_cap_of_results(redis_url):
    async with open_queue(redis_url) as q:
        pubsub = ShardedSubscriber(q.redis)
        await pubsub.subscribe(NOTICE_CHANNEL)
        for rid in ("r0", "r1", "r2"):
            await q.enqueue(rid, items(3), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        claim = await q.claim(600)
        mid = encode_ok(np.ones(7_000, np.float32), 1.0, 2.0)  # 28 kB each, 2 fit in 64 kB
        await q.ack(claim.batch_id, [(e, mid) for e in claim.entries])
        messages = []
        while (message := await pubsub.get_message(timeout=0.3)):
            messages.append(parse_notices(message[1]))
        assert messages == [[("r0", {0: mid}), ("r1", {0: mid})], [("r2", {0: mid})]]
        await pubsub.aclose()


def test_a_truncated_notice_is_refused_not_misread():
    whole = b"8:r1\x000:1:x" + b"2:r2"
    assert parse_notices(whole) == [("r1", {0: b"x"}), ("r2", None)]
    with pytest.raises(ValueError, match="truncated"):
        parse_notices(whole[:-1])


async def test_items_are_queued_in_order_with_their_token_ids(redis_url):
    async with open_queue(redis_url, ManualClock()) as q:
        a_items, b_items = items(2, 7), items(1)
        a = await q.enqueue("a", a_items, timeout_ms=1_000, notice_channel=NOTICE_CHANNEL)
        b = await q.enqueue("b", b_items, timeout_ms=1_000, notice_channel=NOTICE_CHANNEL)
        stored = await q.redis.lrange(q.keys.pending, 0, -1)
        assert stored == list(stored_entries(a, a_items) + stored_entries(b, b_items))
        first = parse_entry(stored[1])
        assert (first.request_id, first.index, first.num_tokens, first.attempt) == ("a", 1, 7, 0)
        assert first.deadline_ms == a.ts_ms + 1_000 == a.deadline_ms
        assert decode_body(first.body).token_ids.tolist() == list(range(100, 107))
        assert int(await q.redis.get(q.keys.tokens)) == 10


async def test_over_cap_request_is_rejected_whole(redis_url):
    async with open_queue(redis_url, max_queued_tokens=100) as q:
        await q.enqueue("small", items(30, 30), timeout_ms=5_000, notice_channel=NOTICE_CHANNEL)
        with pytest.raises(QueueFull) as excinfo:
            await q.enqueue("big", items(10, 20, 20), timeout_ms=5_000, notice_channel=NOTICE_CHANNEL)
        assert excinfo.value.queued_tokens == 60 and excinfo.value.request_tokens == 50
        assert await q.redis.llen(q.keys.pending) == 2
        assert not await q.redis.exists(q.keys.reply("big"))
        stats = await q.stats()
        assert (stats.queued_tokens, stats.counters["rejected"]) == (60, 3)  # items
        # An empty queue takes any one request, so no request is too big to ever be served.
        await q.claim(600)
        await q.enqueue("huge", items(400), timeout_ms=5_000, notice_channel=NOTICE_CHANNEL)
        assert (await q.stats()).queued_tokens == 400


async def test_request_id_with_a_colon_is_refused(redis_url):
    async with open_queue(redis_url) as q:
        with pytest.raises(ValueError, match="no ':'"):
            await q.enqueue("a:b", items(1), timeout_ms=5_000, notice_channel=NOTICE_CHANNEL)
        assert await q.redis.llen(q.keys.pending) == 0


async def test_claim_never_exceeds_budget_and_a_long_item_goes_alone(redis_url):
    async with open_queue(redis_url, lookahead=0) as q:
        await q.enqueue("r", items(300, 200, 200, 900, 5), timeout_ms=5_000, notice_channel=NOTICE_CHANNEL)
        sizes = []
        while (claim := await q.claim(600)) is not None:
            sizes.append([e.num_tokens for e in claim.entries])
        assert sizes == [[300, 200], [200], [900], [5]]


async def test_lookahead_fills_the_budget_past_an_item_that_does_not_fit(redis_url):
    clock = ManualClock()
    async with open_queue(redis_url, clock, lookahead=2, max_skip_age_ms=50) as q:
        await q.enqueue("r", items(400, 300, 100, 100, 50), timeout_ms=5_000, notice_channel=NOTICE_CHANNEL)
        claim = await q.claim(600)
        assert [e.num_tokens for e in claim.entries] == [400, 100, 100]
        # The passed-over item is still first, and goes next.
        claim = await q.claim(600)
        assert [e.num_tokens for e in claim.entries] == [300, 50]


async def test_an_old_item_is_never_passed_over(redis_url):
    clock = ManualClock()
    async with open_queue(redis_url, clock, lookahead=2, max_skip_age_ms=50) as q:
        await q.enqueue("r", items(400, 300, 100), timeout_ms=5_000, notice_channel=NOTICE_CHANNEL)
        clock.advance(50)
        claim = await q.claim(600)
        assert [e.num_tokens for e in claim.entries] == [400]


async def test_expired_deadlines_never_reach_a_model(redis_url):
    clock = ManualClock()
    async with open_queue(redis_url, clock) as q:
        await q.enqueue("late", items(3, 4), timeout_ms=100, notice_channel=NOTICE_CHANNEL)
        await q.enqueue("fine", items(5), timeout_ms=10_000, notice_channel=NOTICE_CHANNEL)
        clock.advance(100)
        claim = await q.claim(600)
        assert [(e.request_id, e.index) for e in claim.entries] == [("fine", 0)]
        assert claim.num_expired == 2
        results = {i: decode_result(r) for i, r in (await q.collect("late")).items()}
        assert sorted(results) == [0, 1]
        assert {r.code for r in results.values()} == {"DEADLINE_EXCEEDED"}
        stats = await q.stats()
        assert (stats.queued_tokens, stats.counters["expired"]) == (0, 2)


async def test_claim_clears_a_run_of_dead_entries_longer_than_one_step(redis_url):
    clock = ManualClock()
    async with open_queue(redis_url, clock, light_tokens=0) as q:  # one lane: dead ones first
        num_dead = MAX_DROPS_PER_CLAIM + 200
        await q.enqueue("late", items(*[1] * num_dead), timeout_ms=10, notice_channel=NOTICE_CHANNEL)
        await q.enqueue("fine", items(2), timeout_ms=10_000, notice_channel=NOTICE_CHANNEL)
        clock.advance(10)
        claim = await q.claim(600)
        assert [e.request_id for e in claim.entries] == ["fine"]
        assert claim.num_expired == num_dead


async def test_cancel_drops_queued_and_inflight_items(redis_url):
    async with open_queue(redis_url) as q:
        await q.enqueue("a", items(10, 10), timeout_ms=5_000, notice_channel=NOTICE_CHANNEL)
        b = await q.enqueue("b", items(7), timeout_ms=5_000, notice_channel=NOTICE_CHANNEL)
        claim = await q.claim(10)  # a's first item is now in flight
        assert await q.cancel("a") is True
        assert await q.cancel("a") is False  # already gone
        # a's queued item leaves at the next claim, its tokens off the count; it never runs.
        nxt = await q.claim(100)
        assert [e.request_id for e in nxt.entries] == ["b"]
        assert await q.redis.lrange(q.keys.pending, 0, -1) == []
        stats = await q.stats()
        assert (stats.queued_tokens, stats.counters["orphaned"], stats.counters["cancelled"]) == (0, 1, 1)
        # The late ack of a cancelled item must not resurrect its reply.
        await q.ack(claim.batch_id, [(e, ok_result(e)) for e in claim.entries])
        assert not await q.redis.exists(q.keys.reply("a"))
        assert await q.collect("a") == {}
        await q.ack(nxt.batch_id, [(e, ok_result(e)) for e in nxt.entries])
        assert sorted(await q.collect(b.request_id)) == [0]


async def test_stats_in_one_call(redis_url):
    clock = ManualClock()
    async with open_queue(redis_url, clock) as q:
        empty = await q.stats()
        assert (empty.queued_entries, empty.oldest_age_ms, empty.counters) == (0, 0, {})
        await q.enqueue("a", items(10, 20, 30), timeout_ms=5_000, notice_channel=NOTICE_CHANNEL)
        clock.advance(250)
        await q.claim(30)
        stats = await q.stats()
        assert (stats.queued_entries, stats.queued_tokens, stats.oldest_age_ms) == (1, 30, 250)
        assert (stats.inflight_items, stats.inflight_batches) == (2, 1)


async def test_budget_round_trip(redis_url):
    async with open_queue(redis_url) as q:
        assert await q.get_budget() is None
        await q.set_budget(4096)
        assert await q.get_budget() == 4096


async def test_concurrent_enqueues_keep_each_request_contiguous(redis_url):
    async with open_queue(redis_url) as q:
        await asyncio.gather(*(q.enqueue(f"r{i}", items(*[1] * 50), timeout_ms=5_000,
                                         notice_channel=NOTICE_CHANNEL) for i in range(8)))
        stored = [parse_entry(raw) for raw in await q.redis.lrange(q.keys.pending, 0, -1)]
        runs = [stored[i:i + 50] for i in range(0, 400, 50)]
        for run in runs:
            assert len({e.request_id for e in run}) == 1
            assert [e.index for e in run] == list(range(50))
        assert (await q.stats()).queued_tokens == sum(e.num_tokens for e in stored) == 400


async def _redis_ms(q) -> int:
    seconds, micros = await q.redis.time()
    return seconds * 1000 + micros // 1000


async def test_heartbeats_are_on_the_redis_clock_and_silent_workers_are_forgotten(redis_url):
    import json

    async with open_queue(redis_url) as q:
        before = await _redis_ms(q)
        now = await q.heartbeat("w1", {"batches": 3}, ttl_ms=2_000, forget_after_ms=10_000)
        after = await _redis_ms(q)
        assert before <= now <= after  # Redis TIME, whatever this host's clock says
        status = json.loads(await q.redis.get(q.keys.heartbeat("w1")))
        assert status == {"batches": 3, "ts_ms": now}
        assert await q.redis.zscore(q.keys.workers, "w1") == now
        assert 0 < await q.redis.pttl(q.keys.heartbeat("w1")) <= 2_000
        await q.forget_worker("w1")
    clock = ManualClock()
    async with open_queue(redis_url, clock) as q:
        await q.heartbeat("old", {}, ttl_ms=2_000, forget_after_ms=10_000)
        clock.advance(10_001)
        await q.heartbeat("new", {}, ttl_ms=2_000, forget_after_ms=10_000)
        assert await q.redis.zrange(q.keys.workers, 0, -1) == [b"new"]
        await q.forget_worker("new")
        assert not await q.redis.exists(q.keys.workers, q.keys.heartbeat("new"))
