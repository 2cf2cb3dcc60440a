"""Every key a queue script touches is in one slot: the keys it declares, and the keys it builds
from ARGV prefixes (reply and lease keys) or publishes on (the notice channel). On a cluster a
script reaching another slot fails; this check catches it on any server, for every script."""

from __future__ import annotations

import pytest
from queue_support import ManualClock, items, ok_result
from redis.crc import key_slot

from tokq.config import QueueConfig
from tokq.redis.connection import connect
from tokq.queue.scripts import script_names
from tokq.queue.sharded import ShardedQueue

pytestmark = pytest.mark.redis_kinds("standalone", "cluster")


def _key_like(arg) -> bool:
    return isinstance(arg, (str, bytes)) and (arg if isinstance(arg, str) else arg.decode(
        errors="replace")).startswith("tokq:")


async def test_every_script_call_stays_in_its_first_key_slot(redis_url):
    calls = []
    client = connect(redis_url)
    clock = ManualClock()
    q = ShardedQueue(client, "model-x", QueueConfig(queue_shards=3, lease_ms=1_000), clock=clock)
    for s in range(3):
        # Every script run goes through one of these (enqueues through the pipeliner, which on a
        # standalone server sends its round trips itself).
        for runner in (q.shard(s).scripts, q.shard(s).pipeliner):
            run = runner.run

            async def recording(name, keys, args, _run=run):
                calls.append((name, list(keys), list(args)))
                return await _run(name, keys, args)

            runner.run = recording
    try:
        for r in range(6):
            await q.producer.enqueue(f"r{r}", items(3, 4), timeout_ms=60_000, gateway_id="gw",
                                     priority="batch" if r % 2 else "interactive")
        claim = await q.consumer.claim(7)
        await q.consumer.renew(claim.batch_id)
        await q.consumer.ack(claim.batch_id, [(e, ok_result(e)) for e in claim.entries])
        await q.producer.collect(claim.entries[0].request_id)
        held = await q.consumer.claim(7)
        clock.advance(5_000)
        await q.consumer.requeue_expired()  # the held batch's lease has expired
        await q.producer.cancel("r5")
        await q.stats.read()
        await q.shard(0).heartbeat("w1", {"model": "model-x"}, ttl_ms=1_000, forget_after_ms=10_000)
    finally:
        await client.aclose()
    assert {name for name, _, _ in calls} == set(script_names())
    assert held is not None
    for name, keys, args in calls:
        slot = key_slot(keys[0].encode())
        assert {key_slot(k.encode()) for k in keys} == {slot}, (name, keys)
        for arg in filter(_key_like, args):
            arg = arg.encode() if isinstance(arg, str) else arg
            assert key_slot(arg) == slot, f"{name}: ARGV {arg!r} is outside {keys[0]}'s slot"
