"""The Lua files themselves: all registered and run, includes expanded, and the client
recovering from a SCRIPT FLUSH or a Redis restart mid-run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tokq.lua
from queue_support import NOTICE_CHANNEL, ManualClock, items, keys_left, ok_result, open_queue

from tokq.queue.wire import decode_result
from tokq.queue.scripts import script_names, script_source

# The same queue code against a standalone server and a node of a real Redis Cluster.
pytestmark = pytest.mark.redis_kinds("standalone", "cluster")

LUA_DIR = Path(tokq.lua.__file__).parent


def test_every_lua_file_is_a_registered_script_with_its_includes_expanded():
    assert set(script_names()) == {p.stem for p in LUA_DIR.glob("*.lua")}
    for name in script_names():
        source = script_source(name)
        assert "--#include" not in source
        assert source.startswith(f"-- {name}.lua:")  # the KEYS/ARGV header comes first
    # The shared result writer exists once, in lib/, and reaches every script that answers.
    for name in ("ack", "claim", "requeue"):
        assert "local function write_result" in script_source(name)


def test_a_reply_delivered_in_its_notice_is_kept_the_grace_of_a_collected_one():
    # One grace written twice (a script cannot import Python's constant): lua/lib/reply.lua keeps
    # a delivered reply, and collect.lua a collected one, for a repeat after a lost answer.
    from tokq.queue.shard import COLLECT_GRACE_MS

    found = re.search(r"^local DELIVERED_TTL_MS = (\d+)$", (LUA_DIR / "lib" / "reply.lua").read_text(), re.M)
    assert found and int(found.group(1)) == COLLECT_GRACE_MS


async def test_every_script_is_exercised(redis_url):
    clock = ManualClock()
    async with open_queue(redis_url, clock, lease_ms=1_000) as q:
        await q.enqueue("kept", items(3, 4), timeout_ms=10_000, notice_channel=NOTICE_CHANNEL)
        dropped = await q.enqueue("dropped", items(5), timeout_ms=10_000, notice_channel=NOTICE_CHANNEL)
        await q.cancel(dropped.request_id)
        claim = await q.claim(600)
        assert await q.renew(claim.batch_id)
        clock.advance(1_000)
        assert await q.requeue_expired() == (2, 0)
        claim = await q.claim(600)  # redone once: back in a normal batch
        await q.ack(claim.batch_id, [(e, ok_result(e)) for e in claim.entries])
        assert sorted(await q.collect("kept")) == [0, 1]
        assert (await q.stats()).counters["requeued"] == 2
        await q.heartbeat("w", {"batches": 1}, ttl_ms=1_000, forget_after_ms=5_000)
        assert set(q.scripts.calls) == set(script_names())


async def test_script_flush_mid_run_recovers(redis_url):
    async with open_queue(redis_url) as q:
        await q.enqueue("r", items(3, 4), timeout_ms=10_000, notice_channel=NOTICE_CHANNEL)
        claim = await q.claim(3)
        await q.redis.script_flush()
        await q.ack(claim.batch_id, [(e, ok_result(e)) for e in claim.entries])
        await q.redis.script_flush()
        claim = await q.claim(600)
        await q.ack(claim.batch_id, [(e, ok_result(e)) for e in claim.entries])
        assert sorted(await q.collect("r")) == [0, 1]
        assert await keys_left(q) == set()


@pytest.mark.redis_kinds("standalone")  # restarts the standalone server
async def test_redis_restart_mid_run_recovers(redis_server, redis_url):
    async with open_queue(redis_url) as q:
        await q.enqueue("lost", items(3), timeout_ms=10_000, notice_channel=NOTICE_CHANNEL)
        await q.claim(600)
        redis_server.restart()  # no persistence: everything queued is gone, as after a crash
        assert (await q.stats()).queued_entries == 0
        await q.enqueue("after", items(2, 2), timeout_ms=10_000, notice_channel=NOTICE_CHANNEL)
        claim = await q.claim(600)
        await q.ack(claim.batch_id, [(e, ok_result(e)) for e in claim.entries])
        results = await q.collect("after")
        assert all(decode_result(r).ok for r in results.values()) and len(results) == 2
