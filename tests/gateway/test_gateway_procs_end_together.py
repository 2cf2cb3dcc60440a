"""`tokq gateway --procs N` (what `tokq up --gateway-procs` runs): one process ending unasked ends
them all with a non-zero exit (its supervisor restarts the gateway instead of the port serving
fewer processes' worth), and its processes die with it when it is killed outright."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest
from service_stack import ServiceStack, alive

from tokq.profiling.bench.spread import gateway_children

pytestmark = pytest.mark.slow


def _gone(pid: int, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.fixture
def stack():
    s = ServiceStack()
    try:
        yield s
    finally:
        s.close()


def _start(stack, by_env: bool = False) -> list[int]:
    if by_env:
        stack.env["TOKQ_PROCS"] = "2"
    stack.start_gateway(*([] if by_env else ["--procs", "2"]))
    deadline = time.monotonic() + 60
    while len(procs := gateway_children(stack.gateway.pid)) < 2:
        assert time.monotonic() < deadline, "two gateway processes never appeared"
        time.sleep(0.1)
    return procs


def test_one_process_dying_ends_the_gateway_with_an_error(stack):
    first, second = _start(stack)
    os.kill(first, signal.SIGKILL)
    assert stack.gateway.wait(timeout=60) != 0
    assert _gone(second)


def test_its_processes_die_with_it_when_it_is_killed_outright(stack):
    procs = _start(stack)
    stack.kill_gateway()  # SIGKILL: no handler runs, only the kernel's parent-death signal
    assert all(_gone(pid) for pid in procs)


@pytest.mark.parametrize("by_env", [False, True], ids=["flag", "TOKQ_PROCS"])
def test_asked_to_stop_it_exits_0(stack, by_env):
    procs = _start(stack, by_env)
    stack.gateway.send_signal(signal.SIGTERM)
    assert stack.gateway.wait(timeout=60) == 0
    assert all(_gone(pid) for pid in procs)


@pytest.mark.parametrize("flag", ["--port", "--http-port", "--metrics-port"])
def test_a_gateway_refuses_a_port_another_process_listens_on(flag):
    """The gateway's sockets set SO_REUSEPORT (its --procs share the port), which would let it
    join a port another gateway listens on, silently, and take a share of its calls."""
    from click.testing import CliRunner

    from tokq.gateway.cli import gateway_command

    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as another gateway's
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        ports = {"--port": "0", "--http-port": "0", "--metrics-port": "0", flag: str(port)}
        args = ["--host", "127.0.0.1", "--redis-url", "redis://127.0.0.1:1/0"]
        result = CliRunner().invoke(gateway_command, [*args, *[x for kv in ports.items() for x in kv]])
    assert result.exit_code == 2, result.output
    name = {"--port": "gRPC", "--http-port": "HTTP", "--metrics-port": "metrics"}[flag]
    assert f"{name} port {port} on 127.0.0.1 already in use" in result.output
