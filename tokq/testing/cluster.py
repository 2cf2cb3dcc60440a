"""A real Redis Cluster on loopback, for the tests and the cluster benchmark: N primaries and N*R
replicas assembled with plain cluster commands, with a short node timeout so a replica takes over
within seconds. A node may announce a proxy's port (``announce_port``; docs/internals.md).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tokq.address import host_port
from tokq.processes import stop_all
from tokq.redis.embedded import default_binary, exit_reason, free_port

NUM_SLOTS = 16384
BUS_OFFSET = 10_000  # a node's cluster bus listens this far above its port


def _slots(client: redis.Redis, real_port: dict[int, int] | None = None
           ) -> list[tuple[int, int, int, list[int]]]:
    """CLUSTER SLOTS as (first slot, last slot, primary port, replica ports); ``real_port`` maps
    announced ports back to the nodes' own."""
    port = (lambda p: real_port.get(int(p), int(p))) if real_port else int
    return [(int(start), int(end), port(primary[1]), [port(r[1]) for r in replicas])
            for start, end, primary, *replicas in client.execute_command("CLUSTER", "SLOTS")]


def _cluster_info(client: redis.Redis) -> dict[str, str]:
    text = client.execute_command("CLUSTER", "INFO")
    return dict(line.split(":", 1) for line in text.split("\r\n") if ":" in line)


@dataclass
class ClusterNode:
    port: int
    dir: str
    proc: subprocess.Popen | None = None
    node_id: str = ""
    replica_of: int | None = None  # the port of the primary it was started to replicate

    def client(self, host: str) -> redis.Redis:
        return redis.Redis(host=host, port=self.port, socket_connect_timeout=0.5,
                           socket_timeout=2.0, decode_responses=True)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def log_path(self) -> str:
        return str(Path(self.dir) / "server.log")


@dataclass
class LocalCluster:
    """``num_primaries`` primaries with ``replicas_per_primary`` replicas each, on 127.0.0.1."""

    binary: str | None = None
    num_primaries: int = 3
    replicas_per_primary: int = 1
    host: str = "127.0.0.1"
    # Short for fast failovers, long enough that a node starved of CPU on a loaded machine is
    # not taken for dead (a spurious failover).
    node_timeout_ms: int = 3_000
    # Called with each node's port before it first starts: the client port the node announces
    # in its place (its cluster bus stays its own, so gossip goes direct).
    announce_port: Callable[[int], int] | None = None
    nodes: list[ClusterNode] = field(default_factory=list)
    announced: dict[int, int] = field(default_factory=dict)  # node port -> announced port

    def __post_init__(self) -> None:
        self.binary = self.binary or default_binary()
        if shutil.which(self.binary) is None and not Path(self.binary).exists():
            raise FileNotFoundError(f"redis server binary {self.binary!r} not found")
        self._dir = tempfile.mkdtemp(prefix="tokq-cluster-")

    # -- addresses ------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """A startup node's URL (any node works: clients discover the rest), at its announced
        address."""
        return self.node_url(self.announced.get(self.nodes[0].port, self.nodes[0].port))

    def node_url(self, port: int) -> str:
        return f"redis://{host_port(self.host, port)}/0"

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    def primary_ports(self) -> list[int]:
        """Ports of the nodes that are primaries now (after failovers too)."""
        client = self._live_client()
        try:
            return sorted({primary for _, _, primary, _ in _slots(client, self._real_port)})
        finally:
            client.close()

    def owner_port(self, key: str) -> int:
        """The port of the primary that owns ``key``'s slot now."""
        client = self._live_client()
        try:
            slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
            for start, end, primary, _ in _slots(client, self._real_port):
                if start <= slot <= end:
                    return primary
        finally:
            client.close()
        raise RuntimeError(f"slot of {key!r} is not served")

    def replica_ports_of(self, primary_port: int) -> list[int]:
        client = self._live_client()
        try:
            for _, _, primary, replicas in _slots(client, self._real_port):
                if primary == primary_port:
                    return replicas
        finally:
            client.close()
        return []

    # -- lifecycle --------------------------------------------------------------------------
    def start(self, timeout_s: float = 30.0) -> LocalCluster:
        num_nodes = self.num_primaries * (1 + self.replicas_per_primary)
        taken: set[int] = set()
        for i in range(num_nodes):
            port = free_port(self.host, offsets=(0, BUS_OFFSET), taken=taken)
            taken |= {port, port + BUS_OFFSET}
            node_dir = Path(self._dir) / str(port)
            node_dir.mkdir()
            node = ClusterNode(port, str(node_dir))
            if self.announce_port is not None:
                self.announced[port] = self.announce_port(port)
            if i >= self.num_primaries:
                node.replica_of = self.nodes[(i - self.num_primaries) % self.num_primaries].port
            self.nodes.append(node)
        try:
            for node in self.nodes:
                self._spawn(node)
            deadline = time.monotonic() + timeout_s
            for node in self.nodes:
                self._wait_ping(node, deadline)
            self._assemble(deadline)
            self.wait_ok(timeout_s=max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.close()
            raise
        return self

    def _spawn(self, node: ClusterNode) -> None:
        args = [self.binary, "--port", str(node.port), "--bind", self.host,
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms),
                # A replica may always take over, however long it was cut off: this cluster
                # exists to test failover, and tokq's leases cover what a stale replica lacks.
                "--cluster-replica-validity-factor", "0",
                # Slots of other primaries keep serving while one primary fails over.
                "--cluster-require-full-coverage", "no",
                "--save", "", "--appendonly", "no", "--dir", node.dir,
                "--protected-mode", "no", "--loglevel", "warning", "--logfile", node.log_path]
        if node.port in self.announced:
            args += ["--cluster-announce-port", str(self.announced[node.port]),
                     "--cluster-announce-bus-port", str(node.port + BUS_OFFSET)]
        node.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     start_new_session=True)

    def _wait_ping(self, node: ClusterNode, deadline: float) -> None:
        client = node.client(self.host)
        try:
            while True:
                if node.proc.poll() is not None:
                    raise RuntimeError(f"{self.binary} on port {node.port} exited at start: "
                                       f"{exit_reason(node.proc, node.log_path)}")
                try:
                    client.ping()
                    node.node_id = client.execute_command("CLUSTER", "MYID")
                    return
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"cluster node on port {node.port} did not answer")
                    time.sleep(0.02)
        finally:
            client.close()

    def _assemble(self, deadline: float) -> None:
        first = self.nodes[0].client(self.host)
        try:
            for node in self.nodes[1:]:
                first.execute_command("CLUSTER", "MEET", self.host, node.port)
        finally:
            first.close()
        per_node = NUM_SLOTS // self.num_primaries
        for i, node in enumerate(self.nodes[:self.num_primaries]):
            start = i * per_node
            end = NUM_SLOTS - 1 if i == self.num_primaries - 1 else start + per_node - 1
            with node.client(self.host) as c:
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", start, end)
        by_port = {n.port: n for n in self.nodes}
        for node in self.nodes[self.num_primaries:]:
            primary_id = by_port[node.replica_of].node_id
            with node.client(self.host) as c:
                # REPLICATE needs the primary known (gossip from MEET); retry until it is.
                while True:
                    try:
                        c.execute_command("CLUSTER", "REPLICATE", primary_id)
                        break
                    except redis.ResponseError:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.05)

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every running node reports ``cluster_state:ok``, agrees on who serves every
        slot, and every running replica's link to its primary is up."""
        deadline = time.monotonic() + timeout_s
        last = ""
        while True:
            last = self._not_ok_reason()
            if not last:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster not ready after {timeout_s:.0f}s: {last}")
            time.sleep(0.1)

    def _not_ok_reason(self) -> str:
        views, running_primaries = set(), set()
        for node in self.nodes:
            if not node.running:
                continue
            try:
                with node.client(self.host) as c:
                    info = _cluster_info(c)
                    if info.get("cluster_state") != "ok":
                        return f"node {node.port}: cluster_state {info.get('cluster_state')}"
                    if int(info.get("cluster_known_nodes", 0)) < len(self.nodes):
                        return f"node {node.port}: knows {info.get('cluster_known_nodes')} nodes"
                    # Replicas too: a node that has not yet heard (by gossip) that a replica
                    # joined lists its primary without it.
                    views.add(tuple(sorted((start, end, primary, tuple(sorted(replicas)))
                                           for start, end, primary, replicas in _slots(c, self._real_port))))
                    repl = c.info("replication")
                    if repl.get("role") == "slave" and repl.get("master_link_status") != "up":
                        return f"node {node.port}: replica link {repl.get('master_link_status')}"
                    if repl.get("role") == "master":
                        running_primaries.add(node.port)
            except redis.RedisError as exc:
                return f"node {node.port}: {exc}"
        if len(views) != 1:
            return f"nodes disagree on slot owners: {sorted(views)}"
        view = next(iter(views))
        primaries = {owner for _, _, owner, _ in view}
        listed_replicas = {r for *_, replicas in view for r in replicas}
        running_replicas = {n.port for n in self.nodes if n.running} - primaries
        if running_replicas - listed_replicas:
            return f"replica(s) {sorted(running_replicas - listed_replicas)} not yet listed in the slot map"
        dead = [p for p in primaries if not self._node(p).running]
        if dead:
            return f"slots still assigned to stopped node(s) {dead}"
        # A restarted, failed-over primary first comes back as a primary without slots, and only
        # then turns into its successor's replica: until it has, the cluster is one replica short.
        rejoining = sorted(running_primaries - primaries)
        if rejoining:
            return f"node(s) {rejoining} rejoining (primary without slots, not yet a replica)"
        return ""

    @property
    def _real_port(self) -> dict[int, int]:
        return {announced: port for port, announced in self.announced.items()}

    def _node(self, port: int) -> ClusterNode:
        return next(n for n in self.nodes if n.port == port)

    def _live_client(self) -> redis.Redis:
        for node in self.nodes:
            if node.running:
                return node.client(self.host)
        raise RuntimeError("no cluster node is running")

    def kill(self, port: int) -> None:
        """SIGKILL one node (a crash: no goodbye to the cluster, unreplicated writes lost)."""
        node = self._node(port)
        if node.proc is not None:
            node.proc.kill()
            node.proc.wait()

    def restart(self, port: int, timeout_s: float = 30.0) -> None:
        """Start a stopped node again on its port; it rejoins from its nodes.conf (a failed-over
        primary comes back as a replica of its successor)."""
        node = self._node(port)
        if node.running:
            return
        self._spawn(node)
        self._wait_ping(node, time.monotonic() + timeout_s)
        self.wait_ok(timeout_s)

    def flushall(self) -> None:
        """Empty every primary (scripts stay loaded)."""
        for port in self.primary_ports():
            with self._node(port).client(self.host) as c:
                c.flushall()

    def close(self) -> None:
        stop_all([n.proc for n in self.nodes if n.proc is not None], timeout_s=5)
        for node in self.nodes:
            if node.proc is not None and node.proc.stderr:
                node.proc.stderr.close()
            node.proc = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
