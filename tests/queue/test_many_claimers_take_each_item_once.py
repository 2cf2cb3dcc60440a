"""Many claimers on one queue: every item claimed exactly once, none lost, batches in budget."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
from queue_support import NOTICE_CHANNEL, items, keys_left, ok_result, open_queue

from tokq.queue.shard import Claim

# The same queue code against a standalone server and a node of a real Redis Cluster.
pytestmark = pytest.mark.redis_kinds("standalone", "cluster")

NUM_CLAIMERS = 8
NUM_REQUESTS = 500
ITEMS_PER_REQUEST = 20
BUDGET = 600


async def _drain(redis_url: str) -> list[Claim]:
    """One worker: claim and ack until the queue is empty, on its own connection."""
    claims = []
    async with open_queue(redis_url) as q:
        while (claim := await q.claim(BUDGET)) is not None:
            claims.append(claim)
            await q.ack(claim.batch_id, [(e, ok_result(e)) for e in claim.entries])
    return claims


async def test_eight_claimers_drain_ten_thousand_items_exactly_once(redis_url):
    rng = random.Random(7)
    async with open_queue(redis_url) as q:
        for r in range(NUM_REQUESTS):
            # Mostly short items and, now and then, one longer than the whole budget.
            counts = [rng.choice((700, 900)) if rng.random() < 0.002 else rng.randint(1, 60)
                      for _ in range(ITEMS_PER_REQUEST)]
            await q.enqueue(f"r{r}", items(*counts), timeout_ms=600_000, notice_channel=NOTICE_CHANNEL)

        per_claimer = await asyncio.gather(*(_drain(redis_url) for _ in range(NUM_CLAIMERS)))

        claims = [c for batch in per_claimer for c in batch]
        seen = Counter((e.request_id, e.index) for c in claims for e in c.entries)
        assert len(seen) == NUM_REQUESTS * ITEMS_PER_REQUEST
        assert set(seen.values()) == {1}
        assert all(c.num_tokens <= BUDGET or len(c.entries) == 1 for c in claims)
        assert len({c.batch_id for c in claims}) == len(claims)
        assert sum(1 for batch in per_claimer if batch) > 1  # the claimers really interleaved

        stats = await q.stats()
        assert (stats.queued_entries, stats.inflight_items, stats.inflight_batches) == (0, 0, 0)
        total = NUM_REQUESTS * ITEMS_PER_REQUEST
        assert stats.counters == {"enqueued": total, "claimed": total, "acked": total,
                                  "batches": len(claims)}
        for r in range(NUM_REQUESTS):
            assert sorted(await q.collect(f"r{r}")) == list(range(ITEMS_PER_REQUEST))
        assert await keys_left(q) == set()
