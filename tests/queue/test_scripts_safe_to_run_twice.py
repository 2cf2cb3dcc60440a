"""Every queue script is safe to run twice: its answer is lost after it ran (tokq/testing/fault_proxy.py
cuts the connection), redis-py runs it again with the same arguments, and Redis ends up exactly
as after one run, with the caller getting the one run's answer. Each state holds batch-class work
beside interactive work: a claimed batch holds both, so ack and requeue handle the batch lane's
record of a lease too."""

from __future__ import annotations

import contextlib
import re

import pytest
from tokq.testing.fault_proxy import FaultProxy, script_sha
from queue_support import NOTICE_CHANNEL, ManualClock, items, keys_left, ok_result, open_queue

from tokq.queue.wire import decode_result, encode_error
from tokq.queue.shard import COLLECT_GRACE_MS, LostAnswer
from tokq.queue.scripts import script_names, script_source

# Batch ids are <random client prefix>-<n>: the control and the proxied run name them differently.
_BATCH_ID = re.compile(r"[0-9a-f]{16}-(\d+)")


async def _dump(q) -> dict:
    """Every key with its value, TTLs as present/absent, batch ids made comparable."""
    r = q.redis
    out = {}
    for key in sorted(await r.keys("*")):
        kind = (await r.type(key)).decode()
        if kind == "string":
            value = await r.get(key)
        elif kind == "list":
            value = await r.lrange(key, 0, -1)
        elif kind == "hash":
            value = sorted((await r.hgetall(key)).items())
        elif kind == "zset":
            value = await r.zrange(key, 0, -1, withscores=True)
        else:
            value = kind
        out[_BATCH_ID.sub(r"B-\1", key.decode())] = (
            kind, _BATCH_ID.sub(r"B-\1", repr(value)), await r.pttl(key) > 0)
    return out


async def _evalsha_calls(q) -> int:
    return (await q.redis.info("commandstats")).get("cmdstat_evalsha", {}).get("calls", 0)


async def _setup_claimed(q):
    await _setup_queued(q)
    claim = await q.claim(15)  # 5 and 6 of r; 7 passed over; batch-class 4 fills the room
    assert claim.num_batch == 1
    return claim


async def _op_enqueue(q, _):
    return await q.enqueue("x", items(3, 4), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)


async def _op_enqueue_batch(q, _):
    return await q.enqueue("xb", items(3, 4), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL, priority="batch")


async def _op_claim(q, _):
    claim = await q.claim(15)
    return [e.raw for e in claim.entries]


async def _op_ack(q, claim):
    return await q.ack(claim.batch_id, [(e, ok_result(e)) for e in claim.entries])


async def _op_renew(q, claim):
    q._clock.advance(500)
    return await q.renew(claim.batch_id)


async def _op_requeue(q, claim):
    q._clock.advance(1_000)
    return await q.requeue_expired()


async def _op_cancel(q, _):
    return await q.cancel("r")


async def _op_collect(q, claim):
    await q.ack(claim.batch_id, [(e, ok_result(e)) for e in claim.entries])
    return await q.collect("r")


async def _op_heartbeat(q, _):
    return await q.heartbeat("w", {"batches": 2}, ttl_ms=5_000, forget_after_ms=10_000)


async def _setup_queued(q):
    await q.enqueue("r", items(5, 6, 7), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
    await q.enqueue("rb", items(4), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL, priority="batch")


async def _setup_answered(q):
    await q.enqueue("r", items(5, 6), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
    await q.enqueue("rb", items(4), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL, priority="batch")
    return await q.claim(600)


# script name -> (state before, the operation, whether the caller gets the one run's answer)
CASES = {
    "enqueue": (_setup_queued, _op_enqueue, True),
    "enqueue-batch": (_setup_queued, _op_enqueue_batch, True),
    "claim": (_setup_queued, _op_claim, True),
    "ack": (_setup_claimed, _op_ack, True),
    "renew": (_setup_claimed, _op_renew, True),
    # A repeat of these finds its work done and says so; the state is what one run leaves.
    "requeue": (_setup_claimed, _op_requeue, False),
    "cancel": (_setup_queued, _op_cancel, False),
    "collect": (_setup_answered, _op_collect, True),
    "heartbeat": (_setup_queued, _op_heartbeat, True),
}


async def _run_case(url, script, *, proxy: FaultProxy | None):
    setup, op, _ = CASES[script]
    script = script.split("-")[0]  # the case's script
    clock = ManualClock()
    async with open_queue(url, clock, lease_ms=1_000) as q:
        await q.redis.flushall()
        state = await setup(q)
        target = q
        async with contextlib.AsyncExitStack() as stack:
            if proxy is not None:
                target = await stack.enter_async_context(open_queue(proxy.url, clock, lease_ms=1_000))
                proxy.cut_next(script_sha(script))
            before = await _evalsha_calls(q)
            answer = await op(target, state)
            runs = await _evalsha_calls(q) - before
        return answer, await _dump(q), runs


@pytest.mark.parametrize("script", sorted(CASES))
async def test_a_script_run_again_after_its_answer_was_lost_changes_nothing(redis_url, script):
    async with open_queue(redis_url) as q:  # loaded, so no run is a NOSCRIPT miss
        for name in script_names():
            await q.redis.script_load(script_source(name))
    proxy = FaultProxy(redis_url).start()
    try:
        once, state_once, runs_once = await _run_case(redis_url, script, proxy=None)
        twice, state_twice, runs_twice = await _run_case(redis_url, script, proxy=proxy)
    finally:
        proxy.close()
    assert proxy.cuts == 1
    assert runs_twice == runs_once + 1  # it really ran a second time, with the same arguments
    assert state_twice == state_once
    if CASES[script][2]:
        assert twice == once


async def test_an_ack_run_again_after_its_answer_was_lost_counts_each_answer_once(redis_url):
    """A batch with one refused item (the worker's error result) and one embedded item: the ack
    runs twice (answer cut, redis-py retries); acked and failed each count their one item."""
    proxy = FaultProxy(redis_url).start()
    try:
        async with open_queue(proxy.url) as q:
            await q.enqueue("r", items(5, 6), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
            claim = await q.claim(600)
            refused, good = claim.entries
            proxy.cut_next(script_sha("ack"))
            await q.ack(claim.batch_id, [(refused, encode_error("INVALID_ARGUMENT", "bad id")),
                                         (good, ok_result(good))])
            assert proxy.cuts == 1
            counters = (await q.stats()).counters
            assert (counters["acked"], counters["failed"]) == (1, 1)
    finally:
        proxy.close()


async def test_a_repeated_enqueue_is_never_rejected_by_the_cap(redis_url):
    """The repeat is recognised before the cap: a full queue does not turn it into QUEUE_FULL."""
    proxy = FaultProxy(redis_url).start()
    try:
        async with open_queue(redis_url, max_queued_tokens=10) as warm:
            await warm.enqueue("warm", items(1), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        async with open_queue(proxy.url, max_queued_tokens=10) as q:
            proxy.cut_next(script_sha("enqueue"))
            enq = await q.enqueue("full", items(9), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
            assert proxy.cuts == 1 and enq.deadline_ms == enq.ts_ms + 60_000
            assert (await q.stats()).queued_tokens == 10
            assert "rejected" not in (await q.stats()).counters
    finally:
        proxy.close()


async def test_a_reused_request_id_is_told_apart_from_a_repeat(redis_url):
    async with open_queue(redis_url) as q:
        first = await q.enqueue("r", items(1, 2), timeout_ms=5_000, notice_channel=NOTICE_CHANNEL)
        assert await q.enqueue("r", items(1, 2), timeout_ms=5_000, notice_channel=NOTICE_CHANNEL) == first
        with pytest.raises(ValueError, match="already used"):
            await q.enqueue("r", items(1), timeout_ms=5_000, notice_channel=NOTICE_CHANNEL)
        assert await q.redis.llen(q.keys.pending) == 2


async def test_a_collected_reply_is_kept_only_a_short_grace(redis_url):
    async with open_queue(redis_url) as q:
        await q.enqueue("r", items(2), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        claim = await q.claim(600)
        await q.ack(claim.batch_id, [(e, ok_result(e)) for e in claim.entries])
        first = await q.collect("r")
        assert await q.collect("r") == first and decode_result(first[0]).ok
        # Gone for every other script: a late ack or a cancel finds nothing to write to.
        assert not await q.redis.exists(q.keys.reply("r"))
        await q.ack(claim.batch_id, [(e, ok_result(e)) for e in claim.entries])
        assert await q.cancel("r") is False
        assert 0 < await q.redis.pttl(q.keys.collected("r")) <= COLLECT_GRACE_MS
        assert await keys_left(q) == set()


async def test_an_answer_lost_on_every_retry_raises_lost_answer(redis_url):
    proxy = FaultProxy(redis_url).start()
    try:
        async with open_queue(proxy.url) as q:
            await q.stats()  # scripts loaded, connection warm
            proxy.cut_rate(1.0, script_sha("enqueue"))
            with pytest.raises(LostAnswer, match="enqueue"):
                await q.enqueue("r", items(1), timeout_ms=5_000, notice_channel=NOTICE_CHANNEL)
            proxy.reset()
            # It did run (three times, as one): queued once, and the caller may now cancel it.
            assert (await q.stats()).queued_entries == 1
            assert await q.cancel("r") is True
    finally:
        proxy.close()


async def test_the_claim_after_a_claim_that_lost_its_answer_gets_that_batch(redis_url):
    """A claim that ran but whose answer was lost after every retry: the worker's next claim
    drew a new batch id, so the leased batch sat leased to a live worker until its lease ended
    (10 s; a 3 s deadline passed meanwhile). The next claim repeats the lost one's id."""
    proxy = FaultProxy(redis_url).start()
    try:
        async with open_queue(proxy.url) as q:
            assert await q.claim(100) is None  # the claim script loaded (else NOSCRIPT is all that is lost)
            await q.enqueue("r", items(5, 5), timeout_ms=3_000, notice_channel=NOTICE_CHANNEL)
            proxy.cut_rate(1.0, script_sha("claim"))
            with pytest.raises(LostAnswer, match="claim"):
                await q.claim(100)
            proxy.reset()
            assert (await q.stats()).inflight_batches == 1  # it ran: leased, its answer lost
            # another kind of claim (a light pre-empting one, a smaller budget) does not get it
            assert await q.claim(10, lanes="light") is None
            assert await q.claim(50) is None
            again = await q.claim(100)
            assert again is not None and len(again.entries) == 2  # the same batch, at once
            assert (await q.stats()).inflight_batches == 1
            await q.ack(again.batch_id, [(e, ok_result(e)) for e in again.entries])
            assert await q.claim(100) is None  # and the ids go on from there
    finally:
        proxy.close()


async def test_an_enqueue_run_after_its_cancel_queues_nothing(redis_url):
    """A call whose enqueue got no answer (given up on a stalled Redis, or cancelled while it was
    out) is cancelled with a mark: that enqueue, run late, queues nothing (its entries would be
    embedded for nobody and its reply key live to its deadline). A cancel after an answered
    enqueue leaves no mark."""
    from tokq.queue.shard import CANCELLED_TTL_MS, RequestCancelled

    async with open_queue(redis_url) as q:
        assert await q.cancel("late", enqueue_answered=False) is False  # it had not run yet
        assert 0 < await q.redis.pttl(q.keys.cancelled("late")) <= CANCELLED_TTL_MS
        with pytest.raises(RequestCancelled):
            await q.enqueue("late", items(3), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        assert (await q.stats()).queued_entries == 0
        assert not await q.redis.exists(q.keys.reply("late"))

        await q.enqueue("answered", items(3), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        assert await q.cancel("answered") is True
        assert not await q.redis.exists(q.keys.cancelled("answered"))
        assert await q.claim(600) is None  # its entry dropped as an orphan
        assert await keys_left(q) == set()
