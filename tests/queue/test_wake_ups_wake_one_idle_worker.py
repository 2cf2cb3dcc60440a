"""Wake-ups wake one idle worker, not the whole idle fleet (lua/lib/wake.lua): an idle
worker registers its batch prefix and listens on its worker channel; enqueue wakes one registered
worker, a claim that leaves work queued wakes the next, a dead one is skipped, and with nobody
registered the notice goes to the shared work channel."""

from __future__ import annotations

import logging

import pytest
import redis.utils
from queue_support import NOTICE_CHANNEL, items, open_queue

from tokq.queue.shard import Queue
from tokq.redis.pubsub import ShardedSubscriber

pytestmark = pytest.mark.redis_kinds("standalone", "cluster")


async def _listener(q: Queue, channel: str) -> ShardedSubscriber:
    sub = ShardedSubscriber(q.redis)
    await sub.subscribe(channel)
    return sub


async def _heard(sub: ShardedSubscriber) -> int:
    """Messages the subscriber got (it waits a little for the first, then takes the rest)."""
    n = 0
    msg = await sub.get_message(timeout=0.3)
    while msg is not None:
        n += 1
        msg = await sub.get_message(timeout=0.05)
    return n


async def test_an_enqueue_wakes_one_idle_worker_and_a_claim_that_leaves_work_the_next(redis_url):
    async with open_queue(redis_url) as a, open_queue(redis_url) as b, open_queue(redis_url) as c:
        workers = [a, b, c]
        owners = [await _listener(q, q.worker_channel) for q in workers]
        broadcast = await _listener(a, a.keys.work_channel)
        for q in workers:
            await q.mark_idle(True)

        await a.enqueue("r", items(5, 5, 5), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        heard = [await _heard(s) for s in owners]
        assert sorted(heard) == [0, 0, 1] and await _heard(broadcast) == 0
        woken = workers[heard.index(1)]
        await woken.mark_idle(False)
        assert len((await woken.claim(5)).entries) == 1  # work is left: one more is woken
        heard_next = [await _heard(s) for s in owners]
        assert sorted(heard_next) == [0, 0, 1] and heard_next.index(1) != heard.index(1)
        for s in [*owners, broadcast]:
            await s.aclose()


async def test_a_dead_registered_worker_is_skipped_and_nobody_registered_means_everyone(redis_url):
    async with open_queue(redis_url) as dead, open_queue(redis_url) as live:
        live_owner = await _listener(live, live.worker_channel)
        broadcast = await _listener(live, live.keys.work_channel)

        async def drain():
            claim = await live.claim(5)
            await live.ack(claim.batch_id, [])

        await dead.mark_idle(True)  # registered, but nobody listens on its channel: skipped,
        await live.enqueue("r", items(5), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)  # then everyone
        assert (await _heard(live_owner), await _heard(broadcast)) == (0, 1)
        assert await live.redis.scard(live.keys.idle) == 0
        await drain()

        await dead.mark_idle(True)
        await live.mark_idle(True)
        await live.enqueue("s", items(5), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        assert (await _heard(live_owner), await _heard(broadcast)) == (1, 0)  # the live one
        await drain()
        for s in (live_owner, broadcast):
            await s.aclose()


async def test_a_worker_that_goes_busy_or_away_leaves_the_idle_set(redis_url):
    async with open_queue(redis_url) as q:
        await q.mark_idle(True)
        await q.mark_idle(True)  # again after each idle wait: the same single member
        assert await q.redis.smembers(q.keys.idle) == {q.batch_prefix.encode()}
        await q.mark_idle(False)
        assert await q.redis.scard(q.keys.idle) == 0
        await q.mark_idle(True)
        await q.forget_worker("w")
        assert await q.redis.scard(q.keys.idle) == 0


async def _said(sub: ShardedSubscriber) -> list[bytes]:
    """The messages' data the subscriber got (waiting a little for the first)."""
    said = []
    msg = await sub.get_message(timeout=0.3)
    while msg is not None:
        said.append(msg[1])
        msg = await sub.get_message(timeout=0.05)
    return said


async def test_light_work_tells_one_worker_in_a_heavy_forward_only_as_the_light_lane_fills(redis_url):
    async with open_queue(redis_url) as a, open_queue(redis_url) as b:
        owners = [await _listener(q, q.worker_channel) for q in (a, b)]
        broadcast = await _listener(a, a.keys.work_channel)
        await a.enqueue("h1", items(200), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)  # heavy, queued
        assert await _said(broadcast) == [b"1"]  # (nobody idle, nobody pre-emptible)
        for q in (a, b):
            await q.mark_preemptible(True)
        await a.enqueue("h2", items(200), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        assert [await _said(s) for s in owners] == [[], []]  # heavy work: nobody is told

        await a.enqueue("l1", items(5), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)  # light lane: empty -> 1
        said = [await _said(s) for s in owners]
        assert sorted(said) == [[], [b"light"]] and await _said(broadcast) == []
        told = (a, b)[said.index([b"light"])]
        assert await a.redis.smembers(a.keys.preemptible) == {({a, b} - {told}).pop().batch_prefix.encode()}
        await a.enqueue("l2", items(5), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)  # lane not empty: silent
        assert [await _said(s) for s in owners] == [[], []]

        claim = await told.claim(128, lanes="light")  # both light requests, no heavy one
        assert sorted(e.request_id for e in claim.entries) == ["l1", "l2"]
        await told.mark_preemptible(True)
        await a.enqueue("l3", items(5), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)  # empty again: told
        assert sorted([await _said(s) for s in owners]) == [[], [b"light"]]
        for s in [*owners, broadcast]:
            await s.aclose()


async def test_an_idle_worker_takes_light_work_before_a_worker_in_a_heavy_forward_is_told(redis_url):
    async with open_queue(redis_url) as idle, open_queue(redis_url) as busy:
        idle_owner, busy_owner = [await _listener(q, q.worker_channel) for q in (idle, busy)]
        await busy.enqueue("h", items(200), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        await busy.mark_preemptible(True)
        await idle.mark_idle(True)
        await busy.enqueue("l", items(5), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        assert (await _said(idle_owner), await _said(busy_owner)) == ([b"work"], [])
        assert await busy.redis.smembers(busy.keys.preemptible) == {busy.batch_prefix.encode()}
        await busy.forget_worker("w")  # a worker that stops leaves the set
        assert await busy.redis.scard(busy.keys.preemptible) == 0
        for s in (idle_owner, busy_owner):
            await s.aclose()


async def test_a_published_message_is_handed_over_without_being_formatted_for_a_log(redis_url):
    # redis-py's own handler for RESP3 pushes builds "Push response: " + str(message) for a
    # DEBUG log line on every message, the repr of all its bytes (a batch's results, for a
    # gateway), even with DEBUG off. Here DEBUG is on, so that line would show.
    logger = logging.getLogger("push_response")
    records = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        async with open_queue(redis_url) as q:
            protocol = q.redis.get_connection_kwargs().get("protocol") or getattr(
                redis.utils, "DEFAULT_RESP_VERSION", 2)
            if int(protocol) != 3:  # RESP2 (redis-py < 8): messages are plain replies, never pushes
                pytest.skip("this client speaks RESP2")
            sub = await _listener(q, "results")
            await q.redis.spublish("results", b"\x00\x01" * 1000)
            assert await _said(sub) == [b"\x00\x01" * 1000]
            await sub.aclose()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert [r.getMessage()[:40] for r in records] == []


async def test_a_subscriber_callback_that_raises_is_logged_and_changes_nothing(redis_url, caplog):
    """A caller's on_up/on_down raising inside the subscriber would end the task that called it
    (the background resubscribe: channels left down for good); it is logged instead."""
    def on_up(channels):
        raise RuntimeError("a caller's bug")

    caplog.set_level(logging.ERROR, logger="tokq.redis.pubsub")
    async with open_queue(redis_url) as q:
        sub = ShardedSubscriber(q.redis, on_up=on_up, label="test notices")
        try:
            await sub.subscribe(q.keys.work_channel)  # announces the channel up: on_up raises
            await q.redis.spublish(q.keys.work_channel, b"still heard")
            assert await _heard(sub) == 1
        finally:
            await sub.aclose()
    assert any("test notices: on_up failed" in r.getMessage() for r in caplog.records)
