"""Every Redis key name tokq uses, in one place.

All keys of one queue share the hash tag ``{<queue>}`` so every Lua script touches a single
slot and runs unchanged on Redis Cluster. The per-request reply keys are built inside the Lua
scripts from ``reply_prefix`` (same tag), because a claim or requeue cannot know in advance
which requests it will answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

# A model's queue name (with its fingerprint after '@'), then for shards > 0 '#<shard>'.
_QUEUE_NAME = re.compile(r"^[A-Za-z0-9._\-@]{1,128}(#[1-9][0-9]{0,3})?$")
FINGERPRINT_CHARS = 8  # 32 bits: versions of one model name colliding by chance is ~never
MAX_SHARDS = 1024


def queue_name_for(model_name: str, fingerprint: str = "") -> str:
    """The queue name of a model: its name with anything outside [A-Za-z0-9._-] made '_', then
    ``@`` and the first characters of its fingerprint (tokq/model/fingerprint.py) when given."""
    suffix = f"@{fingerprint[:FINGERPRINT_CHARS]}" if fingerprint else ""
    name = re.sub(r"[^A-Za-z0-9._\-]", "_", model_name)[:128 - len(suffix)]
    return (name or "default") + suffix


def shard_queue_name(queue: str, shard: int) -> str:
    """The queue of one shard of a model's queue: shard 0 is the queue itself, so raising the shard
    count keeps what is queued; shard s > 0 is ``<queue>#<s>``, its own hash tag, so shards spread
    over a cluster's nodes ('#' is not allowed in a model's queue name)."""
    if not 0 <= shard < MAX_SHARDS:
        raise ValueError(f"shard {shard} out of range 0..{MAX_SHARDS - 1}")
    return queue if shard == 0 else f"{queue}#{shard}"


@dataclass(frozen=True)
class QueueKeys:
    """Key names of one model's queue. Each is formatted once (``cached_property``): an enqueue
    names ten of them."""

    queue: str
    prefix: str = "tokq"

    def __post_init__(self) -> None:
        if not _QUEUE_NAME.match(self.queue):
            raise ValueError(f"queue name {self.queue!r} must match {_QUEUE_NAME.pattern}")

    @cached_property
    def base(self) -> str:
        return f"{self.prefix}:{{{self.queue}}}"

    @cached_property
    def pending(self) -> str:
        """LIST of entries ``tokens::ts_ms::item``, head = oldest."""
        return f"{self.base}:pending"

    @cached_property
    def heavy(self) -> str:
        """LIST, as ``pending``: the heavy lane (requests over ``light_tokens``, redone items;
        tokq/queue/claim_rule.py). ``pending`` is the light lane."""
        return f"{self.base}:heavy"

    @cached_property
    def batch(self) -> str:
        """LIST, as ``pending``: the batch lane, every entry of batch-class requests (redone ones
        too: they keep their class; tokq/queue/priority.py, claim_rule.py)."""
        return f"{self.base}:batch"

    @cached_property
    def tokens(self) -> str:
        """STRING: sum of token counts in every lane (kept by the scripts; the interactive
        class's, for its cap, is this less ``batch_tokens``)."""
        return f"{self.base}:tokens"

    @cached_property
    def batch_tokens(self) -> str:
        """STRING: sum of token counts in the batch lane (for the batch class's cap)."""
        return f"{self.base}:batch-tokens"

    @cached_property
    def leases(self) -> str:
        """ZSET batch_id -> lease deadline (ms, Redis clock)."""
        return f"{self.base}:leases"

    @cached_property
    def lease_prefix(self) -> str:
        """LIST ``<lease_prefix><batch_id>``: the entries of one claimed batch."""
        return f"{self.base}:lease:"

    def lease(self, batch_id: str) -> str:
        return self.lease_prefix + batch_id

    @cached_property
    def lease_batch_counts(self) -> str:
        """HASH batch_id -> how many of its lease's entries (the last ones) are batch-class, for
        leases holding any: a redo puts them back in the batch lane."""
        return f"{self.base}:lease-batch-counts"

    @cached_property
    def inflight(self) -> str:
        """STRING: number of claimed, unacknowledged items."""
        return f"{self.base}:inflight"

    @cached_property
    def counters(self) -> str:
        """HASH of monotonically increasing event counts (requeued, expired, rejected, ...)."""
        return f"{self.base}:counters"

    @cached_property
    def reply_prefix(self) -> str:
        """HASH ``<reply_prefix><request_id>``: fields n, ch and one per answered item."""
        return f"{self.base}:reply:"

    def reply(self, request_id: str) -> str:
        return self.reply_prefix + request_id

    def cancelled(self, request_id: str) -> str:
        """STRING: a cancelled request's mark (cancel.lua), for a while, so an enqueue of it that
        Redis runs after the cancel (its answer lost, its caller gone) queues nothing."""
        return f"{self.base}:cancelled:{request_id}"

    def collected(self, request_id: str) -> str:
        """HASH: a collected reply, kept a short grace so a repeated collect (after a lost
        answer) gets the same results; it expires by itself."""
        return f"{self.base}:collected:{request_id}"

    def notice_channel(self, gateway_id: str) -> str:
        """Shard channel (SSUBSCRIBE) a gateway listens on for notices of complete replies."""
        return f"{self.base}:notice:{gateway_id}"

    @cached_property
    def work_channel(self) -> str:
        """Shard channel idle workers listen on: told when the queue stops being empty."""
        return f"{self.base}:work"

    @cached_property
    def idle(self) -> str:
        """SET of idle workers' ids (their batch ids' prefix): a work wake-up wakes one (lua/lib/wake.lua)."""
        return f"{self.base}:idle"

    @cached_property
    def preemptible(self) -> str:
        """SET of the ids of workers running a heavy forward (mostly heavy-lane or batch-class
        work): light work arriving with no idle worker tells one 'light' (lua/enqueue.lua), and
        it runs that work nested in its forward (workers/preempt.py)."""
        return f"{self.base}:preemptible"

    @cached_property
    def worker_channel_prefix(self) -> str:
        """Shard channel ``<worker_channel_prefix><batch prefix>``: the worker channel a worker
        process subscribes to while it lives (distinct from ``workers`` and ``heartbeat:``).
        requeue.lua SPUBLISHes to the worker of a lease that missed a renewal, and with nobody
        listening (the worker died) redoes the batch at once."""
        return f"{self.base}:worker:"

    @cached_property
    def budget(self) -> str:
        """STRING: the token budget published by ``tokq profile --apply``."""
        return f"{self.base}:budget"

    @cached_property
    def metrics_exporter(self) -> str:
        """STRING (a redis-py Lock, with a TTL): held by the one gateway process that exports
        this model's queue metrics, so a sum() over every gateway's scrape counts them once."""
        return f"{self.base}:metrics-exporter"

    @cached_property
    def shard_counts(self) -> str:
        """ZSET shard count -> last time (ms) a gateway enqueued with that many shards (kept
        on shard 0's keys; workers claim from the most shards seen lately)."""
        return f"{self.base}:shards"

    @cached_property
    def workers(self) -> str:
        """ZSET worker_id -> last heartbeat (ms); members older than the TTL are dead."""
        return f"{self.base}:workers"

    def heartbeat(self, worker_id: str) -> str:
        """STRING with a TTL: present while the worker is alive (JSON status)."""
        return f"{self.base}:heartbeat:{worker_id}"
