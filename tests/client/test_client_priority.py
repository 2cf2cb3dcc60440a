"""The client's ``priority=``: "interactive" and "batch" become tokq.v1.Priority, None leaves it
unset (the API key's default); anything else is a ValueError naming the classes, raised before
any call is sent, by the blocking and the asyncio client alike, and a usage error in `tokq embed`
and `tokq rerank`. Nothing listens on the target: a call that went out would fail UNAVAILABLE."""

from __future__ import annotations

import asyncio

import pytest
from click.testing import CliRunner

from tokq import AsyncClient, Client
from tokq.client import _request, _rerank_request
from tokq.client_cli import embed_command, rerank_command
from tokq.redis.embedded import free_port
from tokq.v1 import embedder_pb2 as pb

BAD = ["BATCH", "low", "", 1, True]
MESSAGE = "priority must be one of 'interactive', 'batch' or None"


def test_each_class_is_sent_as_its_enum_value_and_none_as_unset():
    for priority, value in [("interactive", pb.INTERACTIVE), ("batch", pb.BATCH), (None, pb.PRIORITY_UNSPECIFIED)]:
        assert _request(["q"], False, True, None, None, "", priority).priority == value
        assert _rerank_request("q", ["d"], None, False, False, False, "", priority).priority == value


@pytest.mark.parametrize("priority", BAD)
def test_a_bad_priority_is_a_value_error_before_anything_is_sent(priority):
    with Client(f"127.0.0.1:{free_port()}") as client:
        with pytest.raises(ValueError, match=MESSAGE):
            client.embed(["q"], priority=priority, timeout=1)
        with pytest.raises(ValueError, match=MESSAGE):
            client.embed_full(["q"], priority=priority, timeout=1)
        with pytest.raises(ValueError, match=MESSAGE):
            client.rerank("q", ["d"], priority=priority, timeout=1)
        with pytest.raises(ValueError, match=MESSAGE):
            client.rerank_full("q", ["d"], priority=priority, timeout=1)


def test_the_async_client_refuses_a_bad_priority_alike():
    async def main():
        async with AsyncClient(f"127.0.0.1:{free_port()}") as client:
            for call in (client.embed(["q"], priority="urgent", timeout=1),
                         client.embed_full(["q"], priority="urgent", timeout=1),
                         client.rerank("q", ["d"], priority="urgent", timeout=1),
                         client.rerank_full("q", ["d"], priority="urgent", timeout=1)):
                with pytest.raises(ValueError, match=MESSAGE):
                    await call
    asyncio.run(main())


@pytest.mark.parametrize("command, args", [(embed_command, ["hello"]), (rerank_command, ["q", "d"])])
def test_the_cli_refuses_an_unknown_priority_in_one_line(command, args):
    result = CliRunner().invoke(command, ["--target", f"127.0.0.1:{free_port()}", "--priority", "urgent", *args])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "Invalid value for '--priority': 'urgent' is not one of 'interactive', 'batch'" in result.output
