"""The async queue client: enqueue, claim, renew, ack, requeue, cancel, collect and stats,
each one Lua script run (one round trip) on a ``redis.asyncio`` client; enqueues started while
one is in flight share the next round trip (tokq.redis.pipeline).

Use a client made with ``decode_responses=False`` (``tokq.redis.connection.connect``): entry bodies
and results are binary.
Times come from the Redis clock inside the scripts; ``clock`` overrides it for tests.

Every script is safe to run twice: redis-py runs a command again after a ConnectionError, and
the first run may have happened with only its answer lost. enqueue is idempotent by request
id, claim by the batch id this client picks, collect keeps the reply a short grace; ack,
renew, requeue and cancel are idempotent by nature. When no answer comes even after the
retries, the call raises ``LostAnswer``: its outcome is unknown, and the caller retries it.
"""

from __future__ import annotations

import itertools
import json
import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import redis.asyncio as aioredis
import redis.exceptions

from tokq.queue.claim_rule import Lanes, batch_share_tokens, isolate_attempt_for, preempt_budget
from tokq.config import MAX_TOKEN_BUDGET, QueueConfig
from tokq.queue.wire import Entry, parse_entry
from tokq.queue.keys import QueueKeys
from tokq.queue.priority import DEFAULT_PRIORITY, check_priority
from tokq.redis.pipeline import ScriptPipeliner
from tokq.queue.scripts import Scripts

log = logging.getLogger(__name__)
# Expired or orphaned entries one claim may drop before it answers; the client calls again,
# so a long run of dead entries is cleared in bounded steps, never in one long script.
MAX_DROPS_PER_CLAIM = 1000
_warned_budgets: dict[str, bytes] = {}  # key -> the unusable value last warned about
# Expired leases handled per requeue call.
MAX_BATCHES_PER_REQUEUE = 100
# How long a collected reply is kept for a repeated collect: longer than redis-py's reconnect
# and retries (tokq.redis.connection), short enough that nothing lingers. A reply delivered in its
# notice is kept as long (DELIVERED_TTL_MS in lua/lib/reply.lua).
COLLECT_GRACE_MS = 5_000
# A cancelled request's mark outlives any enqueue of it still on its way: a connection given up
# after redis-py's tries of the 5 s socket timeout (a cluster's three), and a Redis stalled as long.
CANCELLED_TTL_MS = 60_000
# Fields of a reply hash besides the answered items: n, ch, t (lua/lib/reply.lua).
REPLY_META_FIELDS = (b"n", b"ch", b"t")


def parse_notices(data: bytes) -> list[tuple[str, dict[int, bytes] | None]]:
    """A completion message (lua/lib/reply.lua): every request it completes, each with its
    results (index -> raw result, as ``collect`` returns) when the message carries them, else
    None (collect them). One message carries the requests of one gateway a script completed."""
    notices = []
    pos, end = 0, len(data)
    while pos < end:
        colon = data.index(b":", pos)
        start = colon + 1
        stop = start + int(data[pos:colon])
        if stop > end:
            raise ValueError(f"truncated completion notice ({end} bytes, a record ends at {stop})")
        notices.append(_parse_notice(data[start:stop]))
        pos = stop
    return notices


def _parse_notice(record: bytes) -> tuple[str, dict[int, bytes] | None]:
    request_id, sep, rest = record.partition(b"\0")
    if not sep:
        return request_id.decode(), None
    results: dict[int, bytes] = {}
    pos = 0
    while pos < len(rest):
        colon = rest.index(b":", pos)
        start = rest.index(b":", colon + 1) + 1
        end = start + int(rest[colon + 1:start - 1])
        results[int(rest[pos:colon])] = rest[start:end]
        pos = end
    return request_id.decode(), results


def budget_from(value: bytes | str | None, key: str = "") -> int | None:
    """A published budget as Redis holds it: a whole count of 1..MAX_TOKEN_BUDGET tokens, else
    None, as if none were published, with one warning per unusable value. Anything else set by
    hand (128.0, abc, -5, 99999999999) crashed a starting worker, left a running one on its old
    budget logging a failure each second, made a worker warm up with billions of tokens, or made
    the gateway's Info fail INTERNAL."""
    if value is None:
        return None
    raw = value.encode() if isinstance(value, str) else value
    # at most 8 digits before int(): past 4,300 it raises, the crash this guards against
    if raw.isdigit() and len(raw) <= 8 and 1 <= (tokens := int(raw)) <= MAX_TOKEN_BUDGET:
        return tokens
    if _warned_budgets.get(key) != raw:
        _warned_budgets[key] = raw
        log.warning("%s holds %r, not a token budget of 1..%s: ignored, as if none were published "
                    "(tokq profile --apply writes one)", key, raw[:40], f"{MAX_TOKEN_BUDGET:,}")
    return None

class LostAnswer(redis.exceptions.ConnectionError):
    """A queue script got no answer from Redis (connection lost or timed out, even after
    retries): it may or may not have run. Retryable (the gateway answers UNAVAILABLE and
    cancels the request)."""

    def __init__(self, script: str, cause: Exception) -> None:
        super().__init__(f"no answer from Redis to {script} ({type(cause).__name__}); "
                         "it may or may not have run")
        self.script = script


class RequestCancelled(Exception):
    """Enqueue refused: the request was cancelled before this run reached Redis (its caller is
    gone; nothing was queued)."""


class QueueFull(Exception):
    """Enqueue rejected: the request's priority class holds too many queued tokens (maps to
    RESOURCE_EXHAUSTED). Each class has its own cap: ``queued_tokens`` and ``max_queued_tokens``
    are the class's."""

    def __init__(self, queued_tokens: int, request_tokens: int, max_queued_tokens: int,
                 priority: str = DEFAULT_PRIORITY) -> None:
        super().__init__(f"queue full: {queued_tokens} {priority} tokens queued, request of "
                         f"{request_tokens} would pass the cap of {max_queued_tokens}")
        self.queued_tokens = queued_tokens
        self.request_tokens = request_tokens
        self.max_queued_tokens = max_queued_tokens
        self.priority = priority


@dataclass(frozen=True)
class Enqueued:
    request_id: str
    ts_ms: int
    deadline_ms: int


@dataclass(frozen=True)
class Claim:
    batch_id: str
    now_ms: int
    entries: tuple[Entry, ...]
    num_expired: int = 0  # entries dropped for their deadline while claiming
    num_heavy: int = -1  # entries from the heavy lane, after the light ones (-1: unknown, a repeated claim)
    stop: str = ""  # why the batch stopped growing (claim_rule.STOP_REASONS; "": a repeated claim)
    num_batch: int = -1  # entries from the batch lane, the last ones (-1: unknown, a repeated claim)

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries)


@dataclass(frozen=True)
class QueueStats:
    queued_entries: int
    queued_tokens: int
    oldest_age_ms: int
    inflight_items: int
    inflight_batches: int
    counters: dict[str, int]
    num_shards: int = 1  # the shards read (tokq.queue.stats)
    # Those whose stats could not be read (their node unreachable): the figures above leave
    # them out, but for their counters' last reading.
    unreadable_shards: tuple[int, ...] = ()
    # lane ("light", "heavy", "batch") -> (queued entries, queued tokens) (lua/stats.lua)
    lanes: dict[str, tuple[int, int]] = field(default_factory=dict)
    # priority class ("interactive", "batch") -> age of its oldest queued entry (ms)
    oldest_age_ms_by_class: dict[str, int] = field(default_factory=dict)


def _pairs(flat: Sequence[bytes]) -> list[tuple[bytes, bytes]]:
    return list(zip(flat[::2], flat[1::2]))


class Queue:
    def __init__(self, redis: aioredis.Redis, queue: str, config: QueueConfig = QueueConfig(),
                 *, clock: Callable[[], int] | None = None, batch_prefix: str = "") -> None:
        self.redis = redis
        self.keys = QueueKeys(queue)
        self.config = config
        self.scripts = Scripts(redis)
        # Enqueues started while one is in flight share the next round trip (tokq.redis.pipeline).
        self.pipeliner = ScriptPipeliner(redis, self.scripts)
        self._clock = clock
        # Batch ids are <random prefix>-<local counter>, chosen here so that a repeated claim
        # finds its own lease; the prefix keeps them unique across clients and restarts.
        # (tokq.queue.sharded puts the shard first: "<shard>.<random>", so an ack finds its shard.)
        self._batch_prefix = batch_prefix or secrets.token_hex(8)
        self._batch_numbers = itertools.count(1)
        # A claim whose answer was lost, (id, lanes, budget): the next claim of the same kind runs
        # under its id, so that if it ran it returns its lease (else that batch sat leased to a
        # live worker until its lease ended). Only the same kind: a light pre-empting claim must
        # not get a full-budget batch to run nested.
        self._unanswered_claim: tuple[str, str, int] | None = None
        # Set by requeue_expired: ms until the earliest lease is due a check (None: no lease).
        self.next_expiry_ms: int | None = None

    def _now_arg(self) -> int:
        return self._clock() if self._clock else 0  # 0 = the script reads Redis TIME

    async def _run(self, script: str, keys: Sequence[str], args: Sequence, *, pipelined: bool = False) -> object:
        try:
            if pipelined:
                return await self.pipeliner.run(script, keys, args)
            return await self.scripts.run(script, keys, args)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            raise LostAnswer(script, exc) from exc

    async def enqueue(self, request_id: str, items: Sequence[tuple[int, bytes]], *,
                      timeout_ms: int, notice_channel: str, priority: str = DEFAULT_PRIORITY) -> Enqueued:
        """Queue all items of one request (token_count, body), atomically; raises QueueFull.
        Idempotent by ``request_id``: running it again returns the first run's answer.
        ``priority``: one of tokq.queue.PRIORITIES, else ValueError."""
        check_priority(priority)
        if not request_id or ":" in request_id:
            raise ValueError(f"request id {request_id!r} must be non-empty and hold no ':'")
        if not items:
            raise ValueError("a request needs at least one item")
        if timeout_ms <= 0:
            raise ValueError(f"timeout_ms must be positive, got {timeout_ms}")
        cap = self.class_cap(priority)
        args: list = [self._now_arg(), request_id, timeout_ms, cap,
                      self.config.reply_ttl_ms, notice_channel, self.keys.work_channel,
                      self.config.light_tokens, self.keys.worker_channel_prefix, priority]
        for tokens, body in items:
            if tokens < 1:
                raise ValueError(f"an item needs at least one token, got {tokens}")
            args += [int(tokens), body]
        k = self.keys
        reply = await self._run(
            "enqueue", [k.pending, k.tokens, k.counters, k.reply(request_id), k.heavy, k.idle,
                        k.preemptible, k.cancelled(request_id), k.batch, k.batch_tokens], args,
            pipelined=True)
        status = reply[0]
        if status == b"QUEUE_FULL":
            raise QueueFull(int(reply[1]), sum(t for t, _ in items), cap, priority)
        if status == b"CANCELLED":
            raise RequestCancelled(f"request {request_id!r} was cancelled before its enqueue ran")
        if status == b"DUPLICATE":
            raise ValueError(f"request id {request_id!r} is already used by another request")
        return Enqueued(request_id, int(reply[1]), int(reply[2]))

    def class_cap(self, priority: str) -> int:
        """The cap on a priority class's queued tokens (QueueConfig)."""
        if priority == "batch":
            return self.config.max_queued_batch_tokens
        return self.config.max_queued_tokens

    async def cancel(self, request_id: str, *, enqueue_answered: bool = True) -> bool:
        """Cancel a request: its reply key goes now, its queued entries at the next claim
        that reaches them (O(1) here). False if it was already collected or gone. With
        ``enqueue_answered`` False (its enqueue failed or was given up without an answer: it may
        yet run), it is marked cancelled for CANCELLED_TTL_MS, so that a late run queues nothing."""
        k = self.keys
        return bool(await self._run("cancel", [k.reply(request_id), k.counters, k.cancelled(request_id)],
                                    [0 if enqueue_answered else CANCELLED_TTL_MS]))

    async def collect(self, request_id: str) -> dict[int, bytes]:
        """Take a request's results (index -> raw result); its reply key goes (a copy stays
        ``COLLECT_GRACE_MS`` so that running this again returns the same results)."""
        k = self.keys
        flat = await self._run("collect", [k.reply(request_id), k.collected(request_id)],
                               [COLLECT_GRACE_MS])
        return {int(field): value for field, value in _pairs(flat)
                if field not in REPLY_META_FIELDS}

    async def claim(self, token_budget: int, *, lookahead: int | None = None,
                    lanes: Lanes = "both", on_stop: Callable[[str], object] | None = None,
                    after_isolated: bool = False, bulk_forward: bool = False) -> Claim | None:
        """The next batch of at most ``token_budget`` tokens (tokq/queue/claim_rule.py: small requests
        first, within their share; a lane's first item goes even when longer; batch-class work in
        the room left, or its share once starving), leased for ``config.lease_ms``; None when
        nothing is queued. ``lanes``: "light" or "heavy" for a worker in a heavy forward
        (tokq/queue/claim_rule.py). ``on_stop(reason)``: called for a
        batch and for a light-only claim refused as a backlog (claim_rule.STOP_REASONS).
        ``after_isolated``: this worker's last full claim here took a redo to isolate; light work
        goes before an isolated head (claim_rule.plan_claim). ``bulk_forward``: a "light" claim
        nested in a batch-class forward takes what fits rather than refuse a backlog."""
        num_expired = 0
        while True:
            claim, expired, orphaned, stop = await self.claim_step(
                token_budget, lookahead=lookahead, lanes=lanes, after_isolated=after_isolated,
                bulk_forward=bulk_forward)
            num_expired += expired
            if on_stop is not None and (claim is not None or stop == "backlog") and stop:
                on_stop(stop)
            if claim is not None:
                return replace(claim, num_expired=num_expired)
            if expired + orphaned < MAX_DROPS_PER_CLAIM:
                return None  # the queue is empty, not just a long run of dead entries

    async def claim_step(self, token_budget: int, *, lookahead: int | None = None,
                         max_drop: int = MAX_DROPS_PER_CLAIM, lanes: Lanes = "both",
                         preempt_tokens: int | None = None,
                         after_isolated: bool = False,
                         bulk_forward: bool = False) -> tuple[Claim | None, int, int, str]:
        """One run of claim.lua: (the batch or None, entries dropped as expired, entries
        dropped because their request is gone, why the batch stopped growing). It stops after
        ``max_drop`` drops. The batch id is picked here, so a run repeated after a lost answer
        returns the same batch: the next call after a LostAnswer repeats the lost one's id.
        ``preempt_tokens``: the light-only claims' budget (default: claim_rule.preempt_budget of
        ``token_budget``), past which a "heavy" claim reads the light lane first.
        ``bulk_forward``: as Queue.claim's."""
        if token_budget < 1:
            raise ValueError(f"budget must be positive, got {token_budget}")
        k, cfg = self.keys, self.config
        lost = self._unanswered_claim
        if lost and lost[1:] == (lanes, token_budget):
            self._unanswered_claim = None  # taken before the await: a claim beside it never shares it
            asked_id = lost[0]
        else:  # another kind of claim (a pre-empting one beside a prefetch): its own id
            asked_id = f"{self._batch_prefix}-{next(self._batch_numbers)}"
        if preempt_tokens is None:
            preempt_tokens = preempt_budget(token_budget, cfg.light_tokens)
        args = [self._now_arg(), token_budget, cfg.lease_ms,
                cfg.lookahead if lookahead is None else lookahead, cfg.max_skip_age_ms,
                max_drop, k.reply_prefix, k.lease_prefix, asked_id,
                isolate_attempt_for(cfg.max_attempts), k.worker_channel_prefix, lanes, preempt_tokens,
                batch_share_tokens(token_budget, cfg.batch_share), cfg.batch_starve_ms,
                "1" if after_isolated else "0", "1" if bulk_forward else "0"]
        try:
            batch_id, now_ms, expired, orphaned, raw, num_heavy, stop, num_batch = await self._run(
                "claim", [k.pending, k.tokens, k.leases, k.inflight, k.counters, k.heavy, k.idle,
                          k.batch, k.batch_tokens, k.lease_batch_counts], args)
        except LostAnswer:
            self._unanswered_claim = (asked_id, lanes, token_budget)
            raise
        stop = stop.decode() if isinstance(stop, bytes) else str(stop)
        claim = None
        if batch_id:
            claim = Claim(batch_id.decode(), now_ms, tuple(parse_entry(r) for r in raw), expired,
                          int(num_heavy), stop, int(num_batch))
        return claim, int(expired), int(orphaned), stop

    @property
    def batch_prefix(self) -> str:
        """This process's id for this start: it prefixes its batch ids, ends its worker channel's
        name and marks it in the idle and pre-emptible sets."""
        return self._batch_prefix

    @property
    def worker_channel(self) -> str:
        """The channel this client's process subscribes to while it lives: requeue redoes a
        lease that missed a renewal at once when nobody listens on it, and a work wake-up for
        this idle worker comes on it (``mark_idle``)."""
        return self.keys.worker_channel_prefix + self._batch_prefix

    async def mark_idle(self, idle: bool) -> None:
        """Register this client as an idle worker (before it waits for work), or not (it got
        work, or stops): a notice wakes one registered worker, not all (lua/lib/wake.lua)."""
        if idle:
            await self.redis.sadd(self.keys.idle, self.batch_prefix)
        else:
            await self.redis.srem(self.keys.idle, self.batch_prefix)

    async def mark_preemptible(self, preemptible: bool) -> None:
        """Register this client as a worker running a heavy forward (light work arriving then
        tells it 'light' on its worker channel, lua/enqueue.lua), or not (the forward ended)."""
        if preemptible:
            await self.redis.sadd(self.keys.preemptible, self.batch_prefix)
        else:
            await self.redis.srem(self.keys.preemptible, self.batch_prefix)

    async def renew(self, batch_id: str) -> bool:
        """Extend a running batch's lease; False if it was already requeued or acknowledged."""
        args = [self._now_arg(), self.config.lease_ms, batch_id]
        return bool(await self._run("renew", [self.keys.leases], args))

    async def ack(self, batch_id: str, results: Sequence[tuple[Entry, bytes]], *,
                  partial: bool = False) -> None:
        """Deliver each item's result (tokq.queue.wire encode_ok/encode_error bytes) and release
        the lease. Safe to repeat, and safe after the lease was requeued: each item's first
        result is the one its client sees. ``partial``: deliver these results early and keep the
        lease; a later ack releases it and answers the items no ack answered."""
        k = self.keys
        args: list = [k.reply_prefix, batch_id, 1 if partial else 0]
        for entry, result in results:
            args += [entry.request_id, entry.index, result]
        await self._run("ack", [k.leases, k.inflight, k.counters, k.lease(batch_id),
                                k.lease_batch_counts], args)

    async def requeue_expired(self) -> tuple[int, int]:
        """Put the items of expired leases, and of leases whose owner is gone (see
        ``worker_channel``), back at the front of the heavy lane, batch-class ones at the front of
        the batch lane: (requeued, failed). Sets
        ``next_expiry_ms`` (when to call again to check the next lease)."""
        k = self.keys
        args = [self._now_arg(), self.config.max_attempts, MAX_BATCHES_PER_REQUEUE,
                k.reply_prefix, k.lease_prefix, k.work_channel, self.config.lease_ms,
                k.worker_channel_prefix]
        requeued, failed, next_in_ms = await self._run(
            "requeue", [k.leases, k.heavy, k.tokens, k.inflight, k.counters, k.idle, k.batch,
                        k.batch_tokens, k.lease_batch_counts], args)
        self.next_expiry_ms = None if int(next_in_ms) < 0 else int(next_in_ms)
        return int(requeued), int(failed)

    async def heartbeat(self, worker_id: str, status: dict, *, ttl_ms: int,
                        forget_after_ms: int) -> int:
        """Mark ``worker_id`` alive for ``ttl_ms`` with its JSON ``status`` (plus ``ts_ms``), in
        the worker registry at the Redis clock's now (returned); forget silent workers."""
        k = self.keys
        return int(await self._run(
            "heartbeat", [k.workers, k.heartbeat(worker_id)],
            [self._now_arg(), worker_id, json.dumps(status), ttl_ms, forget_after_ms]))

    async def forget_worker(self, worker_id: str) -> None:
        """Remove a worker's heartbeat and registry entry (it stopped, or gave up as hung)."""
        k = self.keys
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(k.heartbeat(worker_id))
            pipe.zrem(k.workers, worker_id)
            pipe.srem(k.idle, self.batch_prefix)
            pipe.srem(k.preemptible, self.batch_prefix)
            await pipe.execute()

    async def stats(self) -> QueueStats:
        k = self.keys
        (entries, tokens, age_ms, inflight, batches, counters, light_entries, heavy_entries,
         light_tokens, heavy_tokens, batch_entries, batch_tokens, interactive_age_ms,
         batch_age_ms) = await self._run(
            "stats", [k.pending, k.tokens, k.leases, k.inflight, k.counters, k.heavy, k.batch,
                      k.batch_tokens], [self._now_arg()])
        return QueueStats(int(entries), int(tokens), int(age_ms), int(inflight), int(batches),
                          {f.decode(): int(v) for f, v in _pairs(counters)},
                          lanes={"light": (int(light_entries), int(light_tokens)),
                                 "heavy": (int(heavy_entries), int(heavy_tokens)),
                                 "batch": (int(batch_entries), int(batch_tokens))},
                          oldest_age_ms_by_class={"interactive": int(interactive_age_ms),
                                                  "batch": int(batch_age_ms)})

    async def get_budget(self) -> int | None:
        """The published budget, None where none is (or what is there is not one: budget_from)."""
        return budget_from(await self.redis.get(self.keys.budget), self.keys.budget)

    async def set_budget(self, tokens: int) -> None:
        if not 1 <= tokens <= MAX_TOKEN_BUDGET:
            raise ValueError(f"budget must be 1..{MAX_TOKEN_BUDGET:,} tokens, got {tokens}")
        await self.redis.set(self.keys.budget, int(tokens))
