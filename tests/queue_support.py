"""Helpers shared by the queue tests (no tests here): a hand-driven clock, a Queue on a fresh
client, item/result builders, and a bounded wait for a condition."""

from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np

from tokq.config import QueueConfig
from tokq.redis.connection import close_client, connect
from tokq.queue.wire import Entry, decode_result, encode_body, encode_ok, format_entry
from tokq.queue.shard import COLLECT_GRACE_MS, REPLY_META_FIELDS, CANCELLED_TTL_MS, Queue

QUEUE = "test-model"
NOTICE_CHANNEL = "tokq:{test-model}:notice:gw-test"
T0_MS = 1_700_000_000_000


class ManualClock:
    """Milliseconds on a clock the test moves; passed to the scripts as their `now`."""

    def __init__(self, now_ms: int = T0_MS) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms

    def advance(self, ms: int) -> None:
        self.now_ms += ms


@contextlib.asynccontextmanager
async def open_queue(redis_url: str, clock: ManualClock | None = None, *, queue: str = QUEUE,
                     **config):
    # The same connection settings as the gateway and workers (reconnects through a restart).
    client = connect(redis_url)
    try:
        yield Queue(client, queue, QueueConfig(**config), clock=clock)
    finally:
        await close_client(client)  # a close slowed past its timeout on a loaded machine is no failure


def stored_entries(enqueued, items_: list[tuple[int, bytes]]) -> tuple[bytes, ...]:
    """The entries enqueue.lua must have stored for these items (tokq.queue.wire's format)."""
    return tuple(format_entry(tokens, enqueued.ts_ms, enqueued.request_id, index,
                              enqueued.deadline_ms, 0, body)
                 for index, (tokens, body) in enumerate(items_))


def items(*token_counts: int) -> list[tuple[int, bytes]]:
    """One item per count: a body of that many token ids (id = 100 + position)."""
    return [(n, encode_body(np.arange(100, 100 + n))) for n in token_counts]


def ok_result(entry: Entry) -> bytes:
    """A recognizable result: a 2-d vector naming the entry's request item and attempt."""
    return encode_ok(np.array([entry.index, entry.attempt], np.float32), 1.0, 2.0)


async def all_keys(queue: Queue) -> set[str]:
    return {k.decode() for k in await queue.redis.keys("*")}


async def keys_left(queue: Queue) -> set[str]:
    """Keys still in Redis besides the event counters. A collected reply stays a short grace
    for a repeated collect (tokq.queue.shard.COLLECT_GRACE_MS), a cancelled request's mark a while
    for an enqueue run late (CANCELLED_TTL_MS): each checked to expire by itself within it,
    then left out."""
    left = set()
    for key in await all_keys(queue):
        if key == queue.keys.counters:
            continue
        for prefix, grace_ms in ((queue.keys.collected(""), COLLECT_GRACE_MS),
                                 (queue.keys.cancelled(""), CANCELLED_TTL_MS)):
            if key.startswith(prefix):
                pttl = await queue.redis.pttl(key)  # -2 or 0: its grace ended as it was listed
                assert pttl in (-2, 0) or 0 < pttl <= grace_ms, (key, pttl)
                break
        else:
            left.add(key)
    return left


async def wait_for(predicate, timeout_s: float, what: str) -> None:
    """Until ``await predicate()`` is true; fails naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def enqueue_ids(queue: Queue, request_id: str, seqs) -> None:
    """Enqueue one request of these token-id sequences (a minute's deadline)."""
    await queue.enqueue(request_id, [(len(s), encode_body(s)) for s in seqs], timeout_ms=60_000,
                        notice_channel=queue.keys.notice_channel("test"))


async def answered_vectors(queue: Queue, request_id: str, n: int) -> np.ndarray:
    """``request_id``'s n vectors, collected as soon as all are answered: a reply delivered in
    its notice is kept only a short grace (lua/lib/reply.lua), which a loaded machine could
    outlast before a collect at a test's end."""
    async def answered():
        return await queue.redis.hlen(queue.keys.reply(request_id)) >= n + len(REPLY_META_FIELDS)
    await wait_for(answered, 60, f"{request_id}'s answer")
    results = await queue.collect(request_id)
    return np.stack([decode_result(results[i]).vector for i in range(n)])


async def queue_cycle(q: Queue, request_id: str = "r1") -> None:
    """One request of two items (3 and 4 tokens) enqueued, claimed, acked and collected: the
    whole cycle through ``q``, checked at each step."""
    await q.enqueue(request_id, items(3, 4), timeout_ms=10_000, notice_channel=q.keys.notice_channel("gw"))
    claim = await q.claim(100)
    assert [e.num_tokens for e in claim.entries] == [3, 4]
    await q.ack(claim.batch_id, [(e, ok_result(e)) for e in claim.entries])
    assert sorted(await q.collect(request_id)) == [0, 1]
