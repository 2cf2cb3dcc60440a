"""Network addresses, IPv4 or IPv6: how ``host:port`` is written (an IPv6 literal in brackets, as
gRPC targets and URLs need it) and whether a port can be bound, in the host's own family."""

from __future__ import annotations

import errno
import socket


def host_port(host: str, port: int) -> str:
    """``host:port`` for gRPC, URLs and logs: "127.0.0.1:50051", "[::1]:50051" (a bare "::1:50051"
    would read as one address); an empty host stays empty (":50051": every interface, to gRPC)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def local_host(host: str) -> str:
    """Where a client on this machine reaches a server listening on ``host``: loopback for a
    wildcard ("", 0.0.0.0, ::), else the host itself."""
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


def bind_address(host: str, port: int) -> tuple[socket.AddressFamily, tuple]:
    """The family and socket address to bind ``host:port`` with; a name binds its IPv4 address where
    it has one ("localhost" may be ::1 first, leaving IPv4 callers out). "" is every IPv4
    interface. Raises socket.gaierror for a name that does not resolve."""
    found = socket.getaddrinfo(host or "0.0.0.0", port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = next((a for a in found if a[0] == socket.AF_INET), found[0])
    return family, address


def bind_error(host: str, port: int, *, reuse_addr: bool = False) -> OSError | None:
    """Why a TCP socket cannot bind ``host:port`` (None: it can; the socket is closed at once).
    ``reuse_addr``: SO_REUSEADDR, so a port left in TIME_WAIT binds."""
    try:
        family, address = bind_address(host, port)
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            if reuse_addr:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as exc:  # socket.gaierror included: a name that does not resolve
        return exc
    return None


def port_in_use(host: str, port: int) -> bool:
    """Whether a socket already listens on ``host:port``, tried with a plain bind: the gateway's
    SO_REUSEPORT would silently join another process's port and take a share of its calls."""
    error = bind_error(host, port, reuse_addr=True)  # SO_REUSEADDR: a port in TIME_WAIT is free
    # Other errors (an address not on this machine, a name that does not resolve): the server says.
    return error is not None and error.errno == errno.EADDRINUSE


def ports_taken(ports) -> str:
    """Of ``ports`` ((name, host, port) each; port 0: off), those another process listens on, for
    a one-line error: "gRPC port 50051 on 127.0.0.1 and metrics port 9400 on 0.0.0.0"; "" if none."""
    return " and ".join(f"{name} port {port} on {host or '0.0.0.0'}" for name, host, port in ports
                        if port and port_in_use(host, port))
