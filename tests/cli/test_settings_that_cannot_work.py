"""Settings that pass their own checks but cannot work together or at all: two settings on one
port, a malformed Redis URL, NaN, and the client's API key variable given to a gateway. Each is
one line at start (no traceback, nothing started), or for the key a warning."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tokq import config as cfg


def _run(name: str, *args: str, env: dict[str, str] | None = None, timeout: float = 120):
    env = {**os.environ, **(env or {}), "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "tokq.cli", name, *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


def _one_error_line(run: subprocess.CompletedProcess, status: int = 2) -> str:
    assert run.returncode == status and "Traceback" not in run.stderr, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, run.stderr
    return errors[0]


# -- one port, two settings --------------------------------------------------------------------

@pytest.mark.parametrize("values,names", [
    ({"port": 8080, "http_port": 8080}, ("port", "http_port")),
    ({"port": 9400, "metrics_port": 9400}, ("port", "metrics_port")),
    ({"http_port": 9400, "metrics_port": 9400}, ("http_port", "metrics_port")),
])
def test_a_gateway_refuses_one_port_for_two_settings(values, names):
    """Both bind with SO_REUSEPORT: gRPC then failed every call ("Failed parsing HTTP/2") while
    HTTP answered; a metrics port on the gRPC port was a traceback."""
    with pytest.raises(cfg.ConfigError) as err:
        cfg.load(cfg.GatewayConfig, values, env={})
    message = str(err.value)
    assert "\n" not in message
    for name in names:
        assert f"{name}=" in message and cfg.env_var(name) in message
    assert cfg.load(cfg.GatewayConfig, {"port": 0, "http_port": 0, "metrics_port": 0}, env={}).port == 0


def test_a_gateway_with_procs_refuses_a_port_among_its_metrics_ports():
    error = _one_error_line(_run("gateway", "--port", "9401", "--metrics-port", "9400", "--procs", "2",
                                 "--redis-url", "redis://127.0.0.1:1/0"))
    assert "port 9401" in error and "--port" in error and "--metrics-port" in error, error
    assert "--procs 2" in error, error
    error = _one_error_line(_run("gateway", "--port", "50051", "--http-port", "50051",
                                 "--redis-url", "redis://127.0.0.1:1/0"))
    assert "--http-port" in error and "TOKQ_PORT" in error, error


@pytest.mark.parametrize("args,needle", [
    (["--port", "8080"], "http_port=8080"),  # the default --http-port: it waited for ever
    (["--port", "9402", "--metrics-port", "9400", "--gateway-procs", "1", "--workers", "2"],
     "worker 1's metrics"),  # 9400 the gateway's, 9401 worker 0's, 9402 worker 1's
    (["--http-port", "9401", "--metrics-port", "9400", "--gateway-procs", "2"], "gateway process 1"),
])
def test_tokq_up_refuses_one_port_for_two_settings_before_starting_anything(args, needle):
    run = _run("up", *args, timeout=60)
    error = _one_error_line(run)
    assert needle in error, error
    assert "Redis" not in run.stdout + run.stderr  # stopped before the embedded Redis started


# -- the client's API key variable -------------------------------------------------------------

@pytest.fixture
def taken_port():
    """A port another process listens on: the command stops there, after its start-up checks."""
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield other.getsockname()[1]


WARNING = "API keys are OFF"


@pytest.mark.parametrize("keys", [{}, {"TOKQ_API_KEYS": "server-key"}], ids=["no keys", "keys"])
def test_a_gateway_given_only_the_clients_key_variable_warns_that_keys_are_off(taken_port, keys):
    """TOKQ_API_KEY is the client's (tokq embed); the gateway reads TOKQ_API_KEYS. It served
    without keys, saying only "API keys off" in an info line."""
    run = _run("gateway", "--host", "127.0.0.1", "--port", str(taken_port), "--http-port", "0",
               "--redis-url", "redis://127.0.0.1:1/0", env={"TOKQ_API_KEY": "client-secret", **keys})
    assert "already in use" in _one_error_line(run)
    warnings = [line for line in run.stderr.splitlines() if WARNING in line]
    if keys:
        assert warnings == [], run.stderr
    else:
        assert len(warnings) == 1, run.stderr
        assert "TOKQ_API_KEYS" in warnings[0] and "--api-key-file" in warnings[0], warnings
    assert "client-secret" not in run.stdout + run.stderr


@pytest.mark.parametrize("keys", [[], ["--api-key", "server-key"]], ids=["no keys", "keys"])
def test_tokq_up_given_only_the_clients_key_variable_warns_that_keys_are_off(taken_port, keys):
    run = _run("up", "--port", str(taken_port), "--http-port", "0", "--metrics-port", "0", *keys,
               env={"TOKQ_API_KEY": "client-secret"}, timeout=60)
    assert "already in use" in _one_error_line(run, status=1)
    warnings = [line for line in run.stderr.splitlines() if WARNING in line]
    assert len(warnings) == (0 if keys else 1), run.stderr
    assert "client-secret" not in run.stdout + run.stderr


# -- malformed Redis URLs ----------------------------------------------------------------------

BAD_URLS = ["localhost:6379", "redis://127.0.0.1:99999/0", "redis://:hunter2@127.0.0.1:99999/0",
            "user:hunter2@localhost:6379", "redis://127.0.0.1:port/0", ""]


@pytest.mark.parametrize("url", BAD_URLS)
def test_a_malformed_redis_url_is_one_line_naming_the_setting_without_its_password(url):
    for cls in (cfg.GatewayConfig, cfg.WorkerConfig, cfg.UpConfig):
        if cls is cfg.UpConfig and not url:
            continue  # tokq up's "": the embedded Redis
        for values, env in (({"redis_url": url}, {}), ({}, {"TOKQ_REDIS_URL": url})):
            with pytest.raises(cfg.ConfigError) as err:
                cfg.load(cls, values, env=env)
            message = str(err.value)
            assert "--redis-url" in message and "TOKQ_REDIS_URL" in message, message
            assert "hunter2" not in message and "\n" not in message, message
    for good in ("redis://127.0.0.1:6379/0", "rediss://:pw@host/1", "unix:///tmp/redis.sock?db=2",
                 "redis://[::1]:6379/0"):
        assert cfg.load(cfg.GatewayConfig, {"redis_url": good}, env={}).redis_url == good
    assert cfg.load(cfg.UpConfig, {}, env={}).redis_url == ""


@pytest.mark.parametrize("name,args", [("gateway", []), ("worker", ["--check"]), ("up", [])])
@pytest.mark.parametrize("url", ["localhost:6379", "redis://:hunter2@127.0.0.1:99999/0"])
def test_a_command_given_a_malformed_redis_url_stops_in_one_line(name, args, url):
    run = _run(name, *args, "--redis-url", url, timeout=60)
    error = _one_error_line(run)
    assert "--redis-url" in error and "hunter2" not in run.stdout + run.stderr, error


# -- NaN ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf"])
def test_a_float_setting_refuses_nan_and_infinity(value):
    for values, env in (({"large_share": value}, {}), ({}, {"TOKQ_LARGE_SHARE": value})):
        with pytest.raises(cfg.ConfigError, match=r"large_share=.* is out of range, must be 0.01..1 "
                           r"\(flag --large-share, env TOKQ_LARGE_SHARE\)"):
            cfg.load(cfg.GatewayConfig, values, env=env)


def test_a_gateway_given_nan_stops_in_one_line():
    # a traceback from gateway/large_lane.py once serving, before
    nowhere = ["--redis-url", "redis://127.0.0.1:1/0"]
    error = _one_error_line(_run("gateway", "--large-share", "nan", *nowhere))
    assert "large_share=nan is out of range" in error, error
    error = _one_error_line(_run("gateway", *nowhere, env={"TOKQ_LARGE_SHARE": "NaN"}))
    assert "env TOKQ_LARGE_SHARE" in error, error
