"""A model's queue as S shards, each a ``Queue`` with its own hash tag.

One queue is one hash slot, so one Redis core: a claim costs Redis tens of microseconds, which
caps one model's fleet however many nodes a cluster has. S shards land on different nodes.

- Enqueue: a request goes whole to one shard (its items stay together, one script), the less
  loaded by queued tokens of two shards picked at random. Loads are read in the background
  (one GET per shard every ``LOAD_REFRESH_S``) and bumped locally by each enqueue, so the pick
  costs no round trip; two random choices stay balanced on such stale loads where "the least
  loaded" would send every gateway to the same shard.
- Claim: shards in rotation, starting after the shard that served the last batch, so no
  non-empty shard waits more than S-1 claims; still one budget-bounded batch from one shard
  per claim. A batch id starts with its shard (``<shard>.<id>``): ack and renew go there.
- Changing S live loses nothing: shard 0 is the unsharded queue, and every gateway records its
  S in ``shard_counts`` (last seen, ms). Workers claim from the most shards any gateway used
  within ``SHARD_COUNT_HORIZON_MS``, and from an older count's shards while they hold entries or
  leases (a deadline may outlast the horizon, a fleet may be down as long); requests and
  batches are routed by their ids, not by the current S.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace

import redis.exceptions

from tokq.tasks import cancel_and_wait
from tokq.queue.claim_rule import Lanes
from tokq.config import QueueConfig
from tokq.queue.wire import Entry
from tokq.queue.keys import MAX_SHARDS, QueueKeys, shard_queue_name
from tokq.queue.shard import Claim, Enqueued, Queue, QueueFull, QueueStats, Withdrawn

LOAD_REFRESH_S = 0.1
LOAD_READ_TIMEOUT_S = 0.5  # a shard's load read not answered by then: left out of the picks
SHARD_COUNT_REFRESH_S = 5.0
SHARD_COUNT_HORIZON_MS = 3_600_000  # an hour; an older count's shards are claimed till empty


class ShardedQueue:
    """The Queue interface over ``config.queue_shards`` shards (see the module doc)."""

    def __init__(self, redis, queue: str, config: QueueConfig = QueueConfig(), *,
                 clock=None, rng: random.Random | None = None) -> None:
        if not 1 <= config.queue_shards <= MAX_SHARDS:
            raise ValueError(f"queue_shards must be in 1..{MAX_SHARDS}, got {config.queue_shards}")
        self.redis = redis
        self.name = queue
        self.config = config
        self._clock = clock
        self._rng = rng or random.Random()
        self._shards: dict[int, Queue] = {}
        # Called with the number of enqueues each round trip to a shard carries (metrics).
        self.observe_enqueues: Callable[[int], None] | None = None
        self._enqueue_hold_s = 0.0
        self.num_shards = config.queue_shards  # gateways enqueue to these
        self._claim_shards = config.queue_shards  # workers claim from these (see refresh)
        self._next_claim = self._rng.randrange(self.num_shards)
        self._loads = [0] * self.num_shards
        self._unreachable = [False] * self.num_shards  # its last load read or enqueue failed
        self._since_read = [0] * self.num_shards  # tokens enqueued since the last read began
        self._loads_at = 0.0
        self._load_task: asyncio.Task | None = None
        self._count_at = -SHARD_COUNT_REFRESH_S
        self._shard_of_request: dict[str, int] = {}
        self._last_counters: dict[int, dict[str, int]] = {}  # per shard, as stats() last read them
        self._counted: dict[int, Counter[str]] = {}  # per shard, the totals stats() reports (_count)
        self._stats_read = False  # a first stats() round answered: a shard first read later is late
        self._batch_token = secrets.token_hex(8)

    # -- shards -----------------------------------------------------------------------------
    def shard(self, index: int) -> Queue:
        """The Queue of shard ``index`` (made on first use: any index a batch id names)."""
        if index not in self._shards:
            # Batch ids name their shard; the token keeps them unique across processes.
            queue = Queue(self.redis, shard_queue_name(self.name, index), self.config,
                          clock=self._clock, batch_prefix=f"{index}.{self._batch_token}")
            queue.pipeliner.observe = self._observe_enqueues
            queue.pipeliner.hold_s = self._enqueue_hold_s
            self._shards[index] = queue
        return self._shards[index]

    @property
    def enqueue_hold_s(self) -> float:
        """tokq.redis.pipeline's ``hold_s`` on every shard (the gateway sets it; 0: never hold)."""
        return self._enqueue_hold_s

    @enqueue_hold_s.setter
    def enqueue_hold_s(self, seconds: float) -> None:
        self._enqueue_hold_s = seconds
        for queue in self._shards.values():
            queue.pipeliner.hold_s = seconds

    def _observe_enqueues(self, num_requests: int) -> None:
        if self.observe_enqueues is not None:
            self.observe_enqueues(num_requests)

    @property
    def keys(self) -> QueueKeys:
        """Shard 0's keys: the model-wide ones (budget, workers, heartbeats, shard counts)."""
        return self.shard(0).keys

    def shard_keys(self) -> list[QueueKeys]:
        return [self.shard(i).keys for i in range(self.num_shards)]

    @classmethod
    def of(cls, queue: Queue) -> ShardedQueue:
        """A one-shard ShardedQueue over an existing Queue (its batch ids name no shard: 0)."""
        sharded = cls(queue.redis, queue.keys.queue, replace(queue.config, queue_shards=1))
        sharded._shards[0] = queue
        return sharded

    @staticmethod
    def shard_of_batch(batch_id: str) -> int:
        return int(batch_id.split(".", 1)[0]) if "." in batch_id else 0

    def shard_of_request(self, request_id: str) -> int | None:
        return self._shard_of_request.get(request_id)

    def reply_key(self, request_id: str) -> str:
        return self.shard(self._shard_of_request.get(request_id, 0)).keys.reply(request_id)

    # -- gateway side -----------------------------------------------------------------------
    def pick_shard(self) -> int:
        """The less loaded of two random shards (by queued tokens, as last read + enqueued),
        among those Redis answered for last; all of them if none did."""
        if self.num_shards == 1:
            return 0
        reachable = [i for i in range(self.num_shards) if not self._unreachable[i]]
        candidates = reachable or range(self.num_shards)
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(candidates, 2)
        return a if self._loads[a] <= self._loads[b] else b

    async def enqueue(self, request_id: str, items: Sequence[tuple[int, bytes]], *,
                      timeout_ms: int, gateway_id: str) -> Enqueued:
        """Queue the request on one shard; its completion notice comes on that shard's
        ``done_channel(gateway_id)``. Every enqueue must end in ``collect`` or ``cancel``."""
        self._maybe_refresh_loads()
        index = self.pick_shard()
        # Recorded before the script runs: a call cancelled mid-enqueue is still cancelled
        # on the shard that may have queued it.
        self._shard_of_request[request_id] = index
        shard = self.shard(index)
        try:
            enqueued = await shard.enqueue(request_id, items, timeout_ms=timeout_ms,
                                           channel=shard.keys.done_channel(gateway_id))
        except (ValueError, QueueFull, Withdrawn):  # nothing queued or to cancel: else kept for good
            self._shard_of_request.pop(request_id, None)
            raise
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            self._unreachable[index] = True  # till a load read reaches it again
            raise
        tokens = sum(t for t, _ in items)
        self._loads[index] += tokens
        self._since_read[index] += tokens
        return enqueued

    async def collect(self, request_id: str) -> dict[int, bytes]:
        index = self._shard_of_request.get(request_id, 0)
        raw = await self.shard(index).collect(request_id)
        self._shard_of_request.pop(request_id, None)
        return raw

    async def cancel(self, request_id: str, *, enqueue_answered: bool = True) -> bool:
        index = self._shard_of_request.pop(request_id, 0)
        return await self.shard(index).cancel(request_id, enqueue_answered=enqueue_answered)

    def forget(self, request_id: str) -> None:
        """Drop a request's shard without touching Redis (rejected whole, or its results came
        in the completion notice: nothing left to collect)."""
        self._shard_of_request.pop(request_id, None)

    def _maybe_refresh_loads(self) -> None:
        if self.num_shards == 1:
            return
        if time.monotonic() - self._loads_at >= LOAD_REFRESH_S and (
                self._load_task is None or self._load_task.done()):
            self._loads_at = time.monotonic()
            self._load_task = asyncio.create_task(self._refresh_loads())

    async def _refresh_loads(self) -> None:
        with contextlib.suppress(Exception):  # stale loads only skew the pick a little
            self._since_read = [0] * self.num_shards
            # Each read bounded: a node that stops answering without a reset would hold its GET
            # for the client's retries of the socket timeout (~15 s in a cluster), and with it
            # every shard's update.
            values = await asyncio.gather(*(asyncio.wait_for(self.redis.get(k.tokens), LOAD_READ_TIMEOUT_S)
                                            for k in self.shard_keys()), return_exceptions=True)
            for i, value in enumerate(values):
                # A shard Redis does not answer for (its node down) is left out of the picks.
                self._unreachable[i] = isinstance(value, Exception)
                if not self._unreachable[i]:  # plus what this process enqueued while GETs ran
                    self._loads[i] = int(value or 0) + self._since_read[i]
            if time.monotonic() - self._count_at >= SHARD_COUNT_REFRESH_S:
                self._count_at = time.monotonic()
                await self.record_shard_count()

    async def record_shard_count(self) -> None:
        """Tell workers this many shards are in use now (ZADD: the member's time only grows)."""
        now_ms = int(time.time() * 1000)
        await self.redis.zadd(self.keys.shard_counts, {str(self.num_shards): now_ms})

    async def close(self) -> None:
        await cancel_and_wait(self._load_task)
        for queue in self._shards.values():  # their pipeliners' held connections, back now
            await queue.pipeliner.aclose()

    # -- worker side ------------------------------------------------------------------------
    async def refresh_shard_count(self) -> int:
        """Claim from the most shards any gateway used within the horizon (or this config's,
        if more), and from an older count's shards while they still hold entries or leases;
        forget older counts once they do not. Returns the shard count claimed from."""
        key = self.keys.shard_counts
        cutoff_ms = int(time.time() * 1000) - SHARD_COUNT_HORIZON_MS
        counts = [(int(m), score) for m, score in await self.redis.zrange(key, 0, -1, withscores=True)]
        n = max([self.config.queue_shards, *(c for c, score in counts if score > cutoff_ms)])
        top = max([n, *(c for c, _ in counts)])
        # A deadline may outlast the horizon (a call's may be up to 24 h: max_timeout_ms), and a fleet may
        # be down for longer: dropped at the horizon, such shards' work was never claimed.
        if top > n and await self._hold_work(range(n, top)):
            n = top
        else:  # by score: a count a gateway records again meanwhile stays
            await self.redis.zremrangebyscore(key, 0, cutoff_ms)
        # Shards no longer claimed from: out of their wake-up sets, else this process's id stays
        # there for good. One that fails is claimed from until the next refresh, which tries again.
        retired = range(n, self._claim_shards)
        left = await asyncio.gather(*(self.shard(i).mark_idle(False) for i in retired),
                                    *(self.shard(i).mark_preemptible(False) for i in retired),
                                    return_exceptions=True)
        if any(isinstance(r, BaseException) for r in left):
            n = self._claim_shards
        self._claim_shards = n
        self._next_claim %= n
        return n

    async def _hold_work(self, shards: range) -> bool:
        """Whether any of ``shards`` holds queued entries or leases (one that cannot be read
        may: True)."""
        answers = await asyncio.gather(*(self.redis.exists(k.pending, k.heavy, k.leases)
                                         for k in (self.shard(i).keys for i in shards)),
                                       return_exceptions=True)
        return any(isinstance(a, BaseException) or a > 0 for a in answers)

    @property
    def claim_shards(self) -> int:
        return self._claim_shards

    async def claim(self, token_budget: int, *, lookahead: int | None = None,
                    lanes: Lanes = "both", on_stop: Callable[[str], object] | None = None) -> Claim | None:
        """One batch from the next non-empty shard in rotation; None when all are empty. A
        shard whose node is down (failing over) is passed over, so the others keep being
        served; a claim that may have run there is redone when its lease expires. Raises
        only when every shard failed. ``on_stop``: as Queue.claim's, for each shard asked."""
        n = self._claim_shards
        errors: list[Exception] = []
        for step in range(n):
            index = (self._next_claim + step) % n
            try:
                claim = await self.shard(index).claim(token_budget, lookahead=lookahead,
                                                      lanes=lanes, on_stop=on_stop)
            except redis.exceptions.RedisError as exc:
                errors.append(exc)
                continue
            if claim is not None:
                self._next_claim = (index + 1) % n
                return claim
        if len(errors) == n:
            raise errors[-1]
        return None

    async def renew(self, batch_id: str) -> bool:
        return await self.shard(self.shard_of_batch(batch_id)).renew(batch_id)

    async def ack(self, batch_id: str, results: Sequence[tuple[Entry, bytes]]) -> None:
        await self.shard(self.shard_of_batch(batch_id)).ack(batch_id, results)

    async def requeue_expired(self) -> tuple[int, int]:
        """Every shard's expired leases redone; a shard whose node is out does not stop the
        others' (its error is raised once they have all run)."""
        done = await _on_every_shard(self.shard(i).requeue_expired() for i in range(self._claim_shards))
        return sum(r for r, _ in done), sum(f for _, f in done)

    def owner_channels(self) -> list[str]:
        """Every claimed shard's owner channel (Queue.owner_channel) of this process."""
        return [self.shard(i).owner_channel for i in range(self._claim_shards)]

    @property
    def next_expiry_ms(self) -> int | None:
        """Ms until the earliest lease on any shard is due a check, as the last requeue saw it."""
        known = [q.next_expiry_ms for i in range(self._claim_shards)
                 if (q := self.shard(i)).next_expiry_ms is not None]
        return min(known, default=None)

    # -- both -------------------------------------------------------------------------------
    async def stats(self) -> QueueStats:
        """Every shard's stats summed (oldest age: the oldest of all). A shard that cannot be
        read (its node unreachable) does not take the others' down: the sums are of the shards
        that answered, ``unreadable_shards`` names the others, and the event totals keep the
        last totals those shards answered (a counter must not fall and jump back). The event
        totals only ever grow, by new events (_count). Raises only when no shard answered."""
        n = max(self.num_shards, self._claim_shards)
        answers = await asyncio.gather(*(self.shard(i).stats() for i in range(n)),
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
        self._stats_read = True
        counters: Counter[str] = Counter()
        for counted in self._counted.values():  # retired shards' too: their totals stay in
            counters.update(counted)
        lanes = {lane: (sum(p.lanes[lane][0] for p in parts if lane in p.lanes),
                        sum(p.lanes[lane][1] for p in parts if lane in p.lanes))
                 for lane in {lane for p in parts for lane in p.lanes}}
        return QueueStats(sum(p.queued_entries for p in parts), sum(p.queued_tokens for p in parts),
                          max(p.oldest_age_ms for p in parts), sum(p.inflight_items for p in parts),
                          sum(p.inflight_batches for p in parts), dict(counters), n, tuple(unreadable),
                          lanes)

    def _count(self, shard: int, read: dict[str, int]) -> None:
        """Shard ``shard``'s event totals as read now, added to what stats() reports so that the
        sum only grows by new events: a total that fell (the shard's node restarted empty, or a
        replica a few writes behind took over) is counted on from its new value, adding nothing
        (at most one export period's events lost), instead of pulling the sum down (which
        Prometheus reads as a reset of the whole sum, then its whole rest as new events); a shard
        first read after the first round (unreadable until then) adds only what happens from
        then on, not its history as a burst."""
        last = self._last_counters.get(shard)
        counted = self._counted.setdefault(shard, Counter())
        if last is None:
            if not self._stats_read:
                counted.update(read)  # the first reading: the totals so far, as Redis has them
        else:
            for name, total in read.items():
                before = last.get(name, 0)
                counted[name] += max(0, total - before)
        self._last_counters[shard] = dict(read)

    def work_channels(self) -> list[str]:
        """The channels an idle worker listens on: every shard it claims from."""
        return [self.shard(i).keys.work_channel for i in range(self._claim_shards)]

    async def heartbeat(self, worker_id: str, status: dict, *, ttl_ms: int,
                        forget_after_ms: int) -> int:
        """Workers register once per model (on shard 0's keys), whatever S is."""
        return await self.shard(0).heartbeat(worker_id, status, ttl_ms=ttl_ms,
                                             forget_after_ms=forget_after_ms)

    async def forget_worker(self, worker_id: str) -> None:
        await self.shard(0).forget_worker(worker_id)
        await asyncio.gather(*(self.shard(i).mark_idle(False) for i in range(1, self._claim_shards)),
                             *(self.shard(i).mark_preemptible(False) for i in range(1, self._claim_shards)))

    async def mark_idle(self, idle: bool) -> None:
        """Queue.mark_idle on every claimed shard."""
        await _on_every_shard(self.shard(i).mark_idle(idle) for i in range(self._claim_shards))

    async def mark_preemptible(self, preemptible: bool) -> None:
        """Queue.mark_preemptible on every claimed shard."""
        await _on_every_shard(self.shard(i).mark_preemptible(preemptible) for i in range(self._claim_shards))

    async def get_budget(self) -> int | None:
        return await self.shard(0).get_budget()

    async def set_budget(self, tokens: int) -> None:
        await self.shard(0).set_budget(tokens)


async def _on_every_shard(commands) -> list:
    """Run one command per shard at once and return their answers; raise the first failure only
    once every shard has answered: returning earlier, a later command (a withdrawal) could
    overtake one still out, and one shard's node out would stop the others' work midway."""
    results = await asyncio.gather(*commands, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results
