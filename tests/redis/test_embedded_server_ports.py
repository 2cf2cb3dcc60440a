"""Ports for the servers tokq starts (tokq/redis/embedded.py): free, outside the kernel's
ephemeral range, and a server that cannot start says why."""

from __future__ import annotations

import os
import socket

import pytest

from tokq.redis import embedded as redis_server
from tokq.redis.embedded import EmbeddedRedis, ephemeral_ports, free_port, free_port_block, port_free


def test_free_ports_are_free_and_below_the_ephemeral_range():
    ephemeral = ephemeral_ports()
    for _ in range(50):
        port = free_port(offsets=(0, 10_000))
        assert 10_000 <= port and port + 10_000 < ephemeral.start  # below it, where it leaves room
        assert port_free(port) and port_free(port + 10_000)
    block = free_port_block(3)
    assert all(port_free(p, "0.0.0.0") and p < ephemeral.start for p in range(block, block + 3))


def test_a_port_in_use_or_taken_is_passed_over(monkeypatch):
    in_use = free_port()
    taken = free_port(taken={in_use})
    free = free_port(taken={in_use, taken})
    picks = iter([in_use, taken, free])
    monkeypatch.setattr(redis_server._PICKS, "randint", lambda low, high: next(picks))
    with socket.socket() as held:
        held.bind(("127.0.0.1", in_use))
        held.listen()
        assert free_port(taken={taken}) == free


@pytest.mark.slow
def test_a_server_that_cannot_start_says_why():
    with EmbeddedRedis() as running:
        with pytest.raises(RuntimeError, match=f"on port {running.port} exited at start: .*Address already in use"):
            EmbeddedRedis(port=running.port).start()


@pytest.mark.slow
def test_a_server_that_never_answers_is_stopped_not_left_running(tmp_path):
    # A start that fails (here: a "server" that never listens) stops what it started: the
    # process runs in its own session, and nobody else holds it to close.
    pidfile = tmp_path / "pid"
    mute = tmp_path / "mute-server"
    mute.write_text(f"#!/bin/sh\necho $$ > {pidfile}\nexec sleep 60\n")
    mute.chmod(0o755)
    server = EmbeddedRedis(binary=str(mute))
    with pytest.raises(TimeoutError, match="did not answer"):
        server.start(timeout_s=1.0)
    assert not server.running
    with pytest.raises(ProcessLookupError):
        os.kill(int(pidfile.read_text()), 0)
    server.close()
