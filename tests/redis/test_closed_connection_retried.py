"""A command on a pooled connection that went away under it is retried on a fresh one, on
asyncio's loop and on uvloop (the gateway's): the server closed it, or the client closed its
transport while it sat in the pool (redis-py's cluster client closes a failed node's free
connections from tasks that run later). uvloop's write on a closed transport raised RuntimeError,
INTERNAL to a caller; tokq/redis/connection.py's send guard fails it as a ConnectionError before it is
sent, which redis-py retries."""

from __future__ import annotations

import asyncio
import sys

import pytest
import redis

from tokq.redis.connection import connect, connect_pubsub
from tokq.gateway.event_loop import loop_factory

LOOPS = ["asyncio"] + ([] if sys.platform == "win32" else ["uvloop"])


async def _server_closed_it(client, sync: redis.Redis) -> None:
    sync.client_kill_filter(_type="normal", skipme=True)
    await asyncio.sleep(0.2)  # the server's FIN has arrived


async def _transport_closed(client, sync: redis.Redis) -> None:
    [conn] = list(client.connection_pool._available_connections)  # the one PING used, now free
    conn._writer.close()  # as a close task of the cluster client does, before it clears _writer
    await asyncio.sleep(0)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("close", [_server_closed_it, _transport_closed], ids=["server", "transport"])
@pytest.mark.parametrize("make", [lambda url: connect(url, max_connections=1), connect_pubsub],
                         ids=["connect", "connect_pubsub"])
def test_a_command_on_a_connection_closed_under_it_is_retried(redis_url, loop, close, make):
    sync = redis.Redis.from_url(redis_url)

    async def main():
        client = make(redis_url)
        try:
            assert await client.ping()
            await close(client, sync)
            assert await client.ping()  # not RuntimeError: retried on a new connection
            assert await client.set("after", b"1") and await client.get("after") == b"1"
        finally:
            await client.aclose()

    with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
        runner.run(main())
    sync.close()


def test_a_client_slow_to_close_is_given_up_not_raised(redis_url, caplog):
    # redis-py raises TimeoutError where closing a socket outlasts the connect timeout (0.5 s):
    # seen on a loaded machine closing a cluster client. A gateway or worker stopping must go on
    # to close its other clients and exit 0, so close_client logs it instead.
    from tokq.redis.connection import close_client

    async def main():
        client = connect(redis_url)
        assert await client.ping()

        async def slow_close():
            raise redis.exceptions.TimeoutError("Timed out closing connection after 0.5")
        real_close, client.aclose = client.aclose, slow_close
        await close_client(client)  # does not raise
        await real_close()
        await close_client(client)  # closing twice is harmless too

    asyncio.run(main())
    assert "Timed out closing connection" in caplog.text
