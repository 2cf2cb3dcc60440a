"""host:port addresses, IPv4 and IPv6 (tokq/address.py): written with an IPv6 literal bracketed,
and ports checked in the host's own family (an IPv4 socket cannot bind "::1", so every port
there read as taken and `tokq up --host ::1` found none free)."""

from __future__ import annotations

import socket

import pytest
import redis

from tokq import address
from tokq.address import host_port, local_host
from tokq.address import port_in_use
from tokq.redis.embedded import EmbeddedRedis, free_port, port_free

from service_stack import needs_ipv6


HOSTS = ["127.0.0.1", pytest.param("::1", marks=needs_ipv6)]


@pytest.mark.parametrize("host, port, written", [
    ("127.0.0.1", 50051, "127.0.0.1:50051"), ("localhost", 80, "localhost:80"),
    ("::1", 50051, "[::1]:50051"), ("::", 9400, "[::]:9400"), ("fe80::1%eth0", 1, "[fe80::1%eth0]:1"),
    ("", 50051, ":50051"),  # every interface, to gRPC
])
def test_host_port_brackets_ipv6_literals(host, port, written):
    assert host_port(host, port) == written


def test_a_wildcard_host_is_reached_on_loopback():
    assert [local_host(h) for h in ("", "0.0.0.0", "::", "::1", "10.0.0.7")] == [
        "127.0.0.1", "127.0.0.1", "::1", "::1", "10.0.0.7"]


def _listening(host: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.bind((host, 0))
    sock.listen()
    return sock


@pytest.mark.parametrize("host", HOSTS)
def test_a_port_is_free_until_something_listens_there(host):
    port = free_port(host)
    assert port_free(port, host) and not port_in_use(host, port)
    with _listening(host) as held:
        taken = held.getsockname()[1]
        assert not port_free(taken, host) and port_in_use(host, taken)


@pytest.mark.parametrize("host", HOSTS)
def test_an_address_not_on_this_machine_is_not_free_but_left_to_the_server(host):
    # TEST-NET addresses: never assigned to a local interface (EADDRNOTAVAIL, not EADDRINUSE).
    elsewhere, port = ("192.0.2.1" if host == "127.0.0.1" else "2001:db8::1"), free_port(host)
    assert not port_free(port, elsewhere) and not port_in_use(elsewhere, port)


@needs_ipv6
def test_an_embedded_redis_on_ipv6_loopback_has_a_bracketed_url_that_answers():
    with EmbeddedRedis(host="::1") as server:
        assert server.url.startswith("redis://:") and f"@[::1]:{server.port}/0" in server.url
        with redis.Redis.from_url(server.url) as client:
            assert client.ping()


def test_a_name_binds_its_ipv4_address_where_it_has_one(monkeypatch):
    """Some /etc/hosts list localhost as ::1 first: the HTTP port bound there alone would refuse
    every IPv4 caller (gRPC binds all of a name's addresses)."""
    answers = [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", 8080, 0, 0)),
               (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 8080))]
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: answers)
    assert address.bind_address("localhost", 8080) == (socket.AF_INET, ("127.0.0.1", 8080))
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: answers[:1])  # IPv6 only
    assert address.bind_address("v6-only-name", 8080) == (socket.AF_INET6, ("::1", 8080, 0, 0))
