"""A model's queue stats for metrics: every shard's depth summed, and event totals that only grow.

A shard that cannot be read (its node unreachable) does not take the others' down: the sums are
of the shards that answered, ``unreadable_shards`` names the others, and the event totals keep
the last totals those shards answered (a counter must not fall and jump back).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import TYPE_CHECKING

from tokq.queue.shard import QueueStats

if TYPE_CHECKING:
    from tokq.queue.sharded import ShardedQueue


class SummedStats:
    """``read()``: one QueueStats over every shard in use (see the module doc)."""

    def __init__(self, sharded: ShardedQueue) -> None:
        self._sharded = sharded
        self._last_counters: dict[int, dict[str, int]] = {}  # per shard, as read() last read them
        self._counted: dict[int, Counter[str]] = {}  # per shard, the totals read() reports (_count)
        self._read_once = False  # a first round answered: a shard first read later is late

    async def read(self) -> QueueStats:
        """Every shard's stats summed (oldest age: the oldest of all). The event totals only
        ever grow, by new events (_count). Raises only when no shard answered."""
        sharded = self._sharded
        n = max(sharded.num_shards, sharded.claim_shards)
        answers = await asyncio.gather(*(sharded.shard(i).stats() for i in range(n)),
                                       return_exceptions=True)
        for answer in answers:
            if isinstance(answer, BaseException) and not isinstance(answer, Exception):
                raise answer  # cancelled
        parts = [a for a in answers if not isinstance(a, BaseException)]
        if not parts:
            raise answers[0]
        unreadable = []
        for i, answer in enumerate(answers):
            if isinstance(answer, BaseException):
                unreadable.append(i)  # its totals stay as last counted: a counter must not fall
            else:
                self._count(i, answer.counters)
        self._read_once = True
        counters: Counter[str] = Counter()
        for counted in self._counted.values():  # retired shards' too: their totals stay in
            counters.update(counted)
        lanes = {lane: (sum(p.lanes[lane][0] for p in parts if lane in p.lanes),
                        sum(p.lanes[lane][1] for p in parts if lane in p.lanes))
                 for lane in {lane for p in parts for lane in p.lanes}}
        ages = {c: max(p.oldest_age_ms_by_class.get(c, 0) for p in parts)
                for c in {c for p in parts for c in p.oldest_age_ms_by_class}}
        return QueueStats(sum(p.queued_entries for p in parts), sum(p.queued_tokens for p in parts),
                          max(p.oldest_age_ms for p in parts), sum(p.inflight_items for p in parts),
                          sum(p.inflight_batches for p in parts), dict(counters), n, tuple(unreadable),
                          lanes, ages)

    def _count(self, shard: int, read: dict[str, int]) -> None:
        """Shard ``shard``'s event totals as read now, added to what read() reports so that the
        sum only grows by new events: a total that fell (the shard's node restarted empty, or a
        replica a few writes behind took over) is counted on from its new value, adding nothing
        (at most one export period's events lost), instead of pulling the sum down (which
        Prometheus reads as a reset of the whole sum, then its whole rest as new events); a shard
        first read after the first round (unreadable until then) adds only what happens from
        then on, not its history as a burst."""
        last = self._last_counters.get(shard)
        counted = self._counted.setdefault(shard, Counter())
        if last is None:
            if not self._read_once:
                counted.update(read)  # the first reading: the totals so far, as Redis has them
        else:
            for name, total in read.items():
                before = last.get(name, 0)
                counted[name] += max(0, total - before)
        self._last_counters[shard] = dict(read)
