"""The client refuses what grpc or protobuf would fail on obscurely (a deadline of inf, a lone
surrogate, a key ending in a newline, ...) with a ValueError or TypeError naming the argument, and
`tokq embed` with one usage error, no traceback; a call without a deadline to a gateway that
stops answering fails UNAVAILABLE (keepalive pings) instead of hanging. Against a real gateway
and worker that take calls only with an API key."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from click.testing import CliRunner

from tokq import AsyncClient, Client, TokqError
from tokq import client as client_module
from tokq.client_cli import embed_command

pytestmark = pytest.mark.slow
API_KEY = "hardening-key"


@pytest.fixture(scope="module")
def stack():
    from service_stack import gateway_and_worker

    with gateway_and_worker(env={"TOKQ_API_KEYS": API_KEY}) as s:
        yield s


@pytest.fixture
def client(stack):
    with Client(stack.target, api_key=API_KEY) as c:
        yield c


def embed_cli(stack, *args: str, api_key: str = API_KEY):
    return CliRunner().invoke(embed_command, ["--target", stack.target, *args], env={"TOKQ_API_KEY": api_key})


def assert_usage_error(result, *words: str) -> None:
    """Exit status 2, click's usage lines and one Error line naming ``words``, no traceback."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    for word in words:
        assert word in errors[0], errors[0]


# -- timeouts ---------------------------------------------------------------------------------

@pytest.mark.parametrize("timeout", [math.inf, 1e10, 1e12, 1e300])
def test_an_unbounded_or_huge_timeout_is_no_deadline_or_a_day(client, timeout):
    # grpc failed each at once with DEADLINE_EXCEEDED
    assert client.embed(["red shoes"], timeout=timeout).shape == (1, 384)
    assert client.tokenize(["red shoes"], timeout=timeout)[0]


def test_huge_timeouts_are_cut_to_the_gateways_longest():
    assert client_module._deadline(1e12) == client_module.MAX_TIMEOUT_S == 86_400
    assert client_module._deadline(math.inf) is None and client_module._deadline(2.5) == 2.5


@pytest.mark.parametrize("timeout", [math.nan, 0, 0.0, -1, -math.inf])
def test_a_nan_zero_or_negative_timeout_is_refused_naming_it(client, timeout):
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        client.embed(["red shoes"], timeout=timeout)
    with pytest.raises(ValueError, match="timeout"):
        client.info(timeout=timeout)
    assert all(c.outstanding == 0 for c in client._pool.connections)


def test_async_client_takes_an_infinite_timeout_and_refuses_nan(stack):
    async def run():
        async with AsyncClient(stack.target, api_key=API_KEY) as aclient:
            vectors = await aclient.embed(["red shoes"], timeout=math.inf)
            with pytest.raises(ValueError, match="timeout"):
                await aclient.embed(["red shoes"], timeout=math.nan)
            return vectors

    assert asyncio.run(run()).shape == (1, 384)


@pytest.mark.parametrize("value", ["nan", "0", "-1"])
def test_tokq_embed_refuses_a_nan_zero_or_negative_timeout(stack, value):
    assert_usage_error(embed_cli(stack, "--timeout", value, "hi"), "--timeout")


def test_tokq_embed_takes_an_infinite_timeout(stack):
    result = embed_cli(stack, "--timeout", "inf", "hi")
    assert result.exit_code == 0, result.output
    assert '"embeddings"' in result.output


# -- dimensions -------------------------------------------------------------------------------

@pytest.mark.parametrize("dims", [-1, 2**32])
def test_dimensions_out_of_range_are_refused_naming_them(client, dims):
    with pytest.raises(ValueError, match="dimensions"):  # protobuf's "Value out of range: -1"
        client.embed(["red shoes"], dimensions=dims)


def test_dimensions_zero_is_the_gateways_to_refuse(client):
    with pytest.raises(TokqError) as caught:
        client.embed(["red shoes"], dimensions=0)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and "dimensions" in caught.value.message
    assert client.embed(["red shoes"], dimensions=128).shape == (1, 128)


@pytest.mark.parametrize("value", ["-1", "0", "4294967296"])
def test_tokq_embed_refuses_dimensions_out_of_range(stack, value):
    assert_usage_error(embed_cli(stack, "--dimensions", value, "hi"), "--dimensions")


# -- text that is not UTF-8, inputs that are not a list of strings ----------------------------

@pytest.mark.parametrize("method", ["embed", "tokenize"])
def test_text_with_a_lone_surrogate_is_refused_naming_the_input(client, method):
    with pytest.raises(ValueError, match="^input 1 is not valid UTF-8"):  # was a raw UnicodeEncodeError
        getattr(client, method)(["ok", "a\udcffb"])
    # other non-ASCII text goes as before
    assert len(getattr(client, method)(["café", "東京", "😀"])) == 3


def test_async_client_refuses_a_lone_surrogate(stack):
    async def run():
        async with AsyncClient(stack.target, api_key=API_KEY) as aclient:
            with pytest.raises(ValueError, match="^input 0 is not valid UTF-8"):
                await aclient.tokenize(["\udcff"])

    asyncio.run(run())


def test_tokq_embed_with_text_that_is_not_utf8_prints_one_line(stack):
    result = embed_cli(stack, "ok", "a\udcffb")
    assert_usage_error(result, "input 1 is not valid UTF-8")


def test_tokq_embed_with_undecodable_argument_bytes_prints_no_traceback(stack):
    # What `tokq embed $'\xff\xfe'` passes: Python decodes argv with surrogateescape.
    proc = subprocess.run([sys.executable, "-m", "tokq.cli", "embed", "--target", stack.target, b"\xff\xfe"],
                          env={**os.environ, "TOKQ_API_KEY": API_KEY}, capture_output=True, timeout=120)
    stderr = proc.stderr.decode(errors="replace")
    assert proc.returncode == 2 and "Traceback" not in stderr, stderr
    assert [line for line in stderr.splitlines() if line.startswith("Error:")] == [
        "Error: input 0 is not valid UTF-8 (a lone surrogate, '\\udcff', at character 0): text inputs "
        "must be UTF-8"], stderr


@pytest.mark.parametrize("texts", [b"text", bytearray(b"text")])
@pytest.mark.parametrize("method", ["embed", "embed_full", "tokenize"])
def test_bytes_are_refused_like_a_bare_string(method, texts):
    with Client("127.0.0.1:9") as unconnected:  # refused before any call
        with pytest.raises(TypeError, match="takes a list of strings; wrap a single text in a list"):
            getattr(unconnected, method)(texts)


def test_an_input_that_is_not_a_string_is_refused_naming_it():
    with Client("127.0.0.1:9") as unconnected:
        with pytest.raises(TypeError, match="input 1 is bytes"):
            unconnected.embed(["ok", b"bytes"])


# -- API keys ---------------------------------------------------------------------------------

@pytest.mark.parametrize("suffix", ["\n", "\r\n", " \t"])
def test_an_api_key_with_trailing_whitespace_is_stripped(stack, suffix):
    # as the gateway strips keys; grpc failed the call: INTERNAL "Invalid metadata"
    with Client(stack.target, api_key=API_KEY + suffix) as keyed:
        assert keyed.embed(["red shoes"], timeout=30).shape == (1, 384)


@pytest.mark.parametrize("key", ["kéy", "hardening\nkey", "key\x00"])
def test_an_api_key_that_metadata_cannot_carry_is_refused_naming_it(stack, key):
    with pytest.raises(ValueError, match="api_key must be printable ASCII"):
        with Client(stack.target, api_key=key) as keyed:
            keyed.embed(["red shoes"], timeout=30)


def test_a_blank_api_key_sends_none(stack):
    with Client(stack.target, api_key=" \n") as keyed:
        with pytest.raises(TokqError) as caught:
            keyed.embed(["red shoes"], timeout=30)
    assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_tokq_embed_strips_the_key_and_refuses_one_metadata_cannot_carry(stack):
    result = embed_cli(stack, "hi", api_key=API_KEY + "\n")
    assert result.exit_code == 0, result.output
    assert_usage_error(embed_cli(stack, "hi", api_key="kéy"), "api_key", "TOKQ_API_KEY")


# -- AsyncClient made outside a running loop ------------------------------------------------

def test_async_client_made_outside_a_running_loop_says_so():
    with pytest.raises(RuntimeError, match="inside a coroutine"):  # not "attached to a different loop" later
        AsyncClient("127.0.0.1:9")


# -- a gateway that stops answering ------------------------------------------------------------

def test_a_call_without_deadline_to_a_frozen_gateway_fails_unavailable(stack, monkeypatch):
    """SIGSTOP: the connection stays open but nothing answers. Keepalive pings (shortened here)
    go unanswered, so the call fails after about their time + timeout; it hung forever before."""
    monkeypatch.setattr(client_module, "KEEPALIVE_TIME_MS", 1000)
    monkeypatch.setattr(client_module, "KEEPALIVE_TIMEOUT_MS", 1000)
    outcome: list = []

    def call(c: Client) -> None:
        start = time.monotonic()
        try:
            c.embed(["red shoes"])  # no timeout
            outcome.append(("OK", time.monotonic() - start))
        except TokqError as exc:
            outcome.append((exc.code.name, time.monotonic() - start))

    c = Client(stack.target, api_key=API_KEY, connections=1)
    try:
        assert c.embed(["warm up"], timeout=30).shape == (1, 384)  # connected
        stack.gateway.send_signal(signal.SIGSTOP)
        thread = threading.Thread(target=call, args=(c,), daemon=True)
        thread.start()
        thread.join(timeout=20)
        assert outcome, "the call to the frozen gateway still hangs after 20 s"
    finally:
        c.close()  # ends a call still hanging
        stack.gateway.send_signal(signal.SIGCONT)
    [(code, elapsed)] = outcome
    assert code == "UNAVAILABLE" and elapsed < 10, outcome
    with Client(stack.target, api_key=API_KEY) as after:  # the gateway serves on once resumed
        assert after.embed(["red shoes"], timeout=30).shape == (1, 384)


def test_keepalive_pings_do_not_fail_a_call_waiting_for_its_reply(stack, monkeypatch):
    """A call waits (its worker stopped) while pings go every second: the client stops after
    grpc's 2 pings without data, so a gateway on grpc's default ping policy (one per 5 min)
    does not answer GOAWAY too_many_pings (UNAVAILABLE); the call ends at its deadline."""
    monkeypatch.setattr(client_module, "KEEPALIVE_TIME_MS", 1000)
    monkeypatch.setattr(client_module, "KEEPALIVE_TIMEOUT_MS", 1000)
    with Client(stack.target, api_key=API_KEY, connections=1) as c:
        assert c.embed(["warm up"], timeout=30).shape == (1, 384)
        stack.signal_worker("w1", signal.SIGSTOP)
        try:
            with pytest.raises(TokqError) as caught:
                c.embed(["red shoes"], timeout=8)
        finally:
            stack.signal_worker("w1", signal.SIGCONT)
    assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, caught.value
    stack.wait_ready()
