"""Leases: the batches a worker holds stay leased to it (renewed every third of a lease) until
they are acknowledged, and any worker's expired leases are requeued, so that a crashed worker's
batches are redone elsewhere. A worker that gave up (a hung forward) renews nothing more.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from tokq.queue.consumer import Consumer
from tokq.queue.shard import Claim
from tokq.workers.chores import REDIS_ERRORS, REDIS_RETRY_S, every
from tokq.workers.runner import BatchOutcome

log = logging.getLogger("tokq.worker")

ACK_ATTEMPTS = 10
# The requeue chore calls this long after a lease's deadline (Redis and host clocks tick apart).
EXPIRY_SLACK_S = 0.005


class Leases:
    """The leases of the batches in ``held``, on ``consumer``'s shards. ``healthy()``: False once
    the worker gave up (its leases are then left to expire)."""

    def __init__(self, consumer: Consumer, lease_ms: int, *, healthy: Callable[[], bool],
                 observer=None) -> None:
        self.consumer = consumer
        self.lease_ms = lease_ms
        self.healthy = healthy
        self.observer = observer
        self.held: set[str] = set()  # batch ids whose leases we renew

    async def answer_early(self, part: Claim, outcome: BatchOutcome) -> None:
        """Deliver a part of a held lease's results now and keep renewing the lease (a partial
        ack, tried once): if it fails, the lease's final ``ack`` carries them again."""
        try:
            await self.consumer.ack(part.batch_id, outcome.results, partial=True)
        except REDIS_ERRORS as exc:
            log.warning("early answer of batch %s failed (%s); left to its final ack", part.batch_id, exc)
            if self.observer:
                self.observer.observe_error("redis")

    async def ack(self, claim: Claim, outcome: BatchOutcome) -> None:
        """Deliver ``outcome``'s results and release the lease (retried), then stop renewing it."""
        for attempt in range(ACK_ATTEMPTS):
            try:
                await self.consumer.ack(claim.batch_id, outcome.results)
                break
            except REDIS_ERRORS as exc:
                log.warning("ack of batch %s failed (%s), attempt %d", claim.batch_id, exc, attempt + 1)
                if self.observer:
                    self.observer.observe_error("redis")
                await asyncio.sleep(REDIS_RETRY_S)
        else:
            # Give up: the lease expires and another worker redoes the batch (acks are idempotent).
            log.error("batch %s not acknowledged; it will be redone after its lease", claim.batch_id)
        self.held.discard(claim.batch_id)

    async def renew_held(self) -> None:
        """Chore: every held lease renewed, a third of a lease apart."""
        period_s = self.lease_ms / 3000

        async def renew_one(batch_id: str) -> None:
            # Bounded by the period: a silent node (3 x 5 s on a cluster) must not hold up the
            # next round's renewals on the others past their lease.
            if not await asyncio.wait_for(self.consumer.renew(batch_id), period_s) and batch_id in self.held:
                # Requeued already (we stalled past the lease): another worker may redo it;
                # our ack still counts once, the first answer wins.
                log.warning("lease of batch %s expired before it finished", batch_id)

        async def renew():
            # Every held batch at once: one shard's node out (refusing, or silent) must not leave
            # the batches on healthy shards unrenewed until another worker redoes them.
            held = list(self.held if self.healthy() else ())
            failed = [r for r in await asyncio.gather(*map(renew_one, held), return_exceptions=True)
                      if isinstance(r, BaseException)]
            for error in failed:
                if not isinstance(error, Exception):
                    raise error  # cancelled
            if failed:
                raise failed[0]  # logged once per outage by every()
        await every(period_s, renew)

    async def redo_expired(self) -> None:
        """Chore: every half lease, and as soon as the earliest lease is due a check (half a
        lease before its deadline): a lease that missed a renewal is redone then if its owner's
        process is gone (its worker channel has no subscriber), else when it expires."""
        period_s = self.lease_ms / 2000

        def wait_s() -> float:
            next_ms = self.consumer.next_expiry_ms
            return period_s if next_ms is None else min(period_s, next_ms / 1000 + EXPIRY_SLACK_S)
        await every(wait_s, self.consumer.requeue_expired)
