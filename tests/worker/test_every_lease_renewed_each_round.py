"""Lease renewal: every held batch is renewed each round, whatever happens to one of them. One
shard's node out (refusing, or silent) failed the round at its batch, so the batches after it
on healthy shards went unrenewed until another worker redid them (a queue bug hunt)."""

from __future__ import annotations

import asyncio

import pytest
import redis.exceptions

from tokq.config import QueueConfig
from tokq.workers.leases import Leases


class _Queue:
    """renew() as shards answer it: one batch's node refuses, one's is silent, others renew."""

    def __init__(self) -> None:
        self.renewed: list[str] = []

    async def renew(self, batch_id: str) -> bool:
        if batch_id.startswith("refused"):
            raise redis.exceptions.ConnectionError("Connection refused")
        if batch_id.startswith("silent"):
            await asyncio.sleep(3600)
        self.renewed.append(batch_id)
        return True


@pytest.mark.parametrize("held", [["refused", "silent", "ok-1", "ok-2"], ["ok-1", "silent", "refused", "ok-2"]])
async def test_a_failing_or_silent_shard_does_not_stop_the_others_renewals(held):
    leases = Leases(_Queue(), QueueConfig(lease_ms=300).lease_ms, healthy=lambda: True)
    leases.held = dict.fromkeys(held)  # in this order
    task = asyncio.create_task(leases.renew_held())
    await asyncio.sleep(0.45)  # a round every 0.1 s, a silent renewal given up after 0.1 s
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    rounds = leases.consumer.renewed.count("ok-1")
    assert rounds >= 2 and leases.consumer.renewed.count("ok-2") == rounds, leases.consumer.renewed
