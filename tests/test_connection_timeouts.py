"""Read timeouts are not retried (tokq/connection.py): a command whose answer does not come
within the socket timeout fails to the caller, run once: it may have run, and the caller
decides. Real servers.
"""

from __future__ import annotations

import contextlib

import pytest
import redis
import redis.asyncio as aioredis
from fault_proxy import FaultProxy

import tokq.connection
from tokq.connection import connect


@pytest.mark.redis_kinds("standalone")
async def test_a_command_whose_answer_times_out_is_not_sent_again(redis_url, monkeypatch):
    # The retry policy retries connection errors, not timeouts: the command may have run (here
    # it did, its answer withheld), so it fails to the caller, run once. Retried, it would run
    # again on a new connection, and answer.
    monkeypatch.setattr(tokq.connection, "SOCKET_TIMEOUT_S", 0.5)
    proxy = FaultProxy(redis_url).start()
    client = connect(proxy.url, cluster="no")
    try:
        assert await client.ping()  # connected: only the command's answer can be late
        proxy.hold_next(b"INCR")
        with pytest.raises(redis.exceptions.TimeoutError, match="reading"):
            await client.incr("runs")
        async with contextlib.aclosing(aioredis.Redis.from_url(redis_url)) as direct:
            assert await direct.get("runs") == b"1"
    finally:
        await client.aclose()
        proxy.close()
