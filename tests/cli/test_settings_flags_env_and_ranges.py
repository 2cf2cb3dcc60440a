"""Config you can discover: every field is a flag on every CLI that uses it, --help shows its env
var and default, and a value out of range stops the command with one line (exit status 2)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from tokq import config as cfg
from tokq.gateway.cli import gateway_command
from tokq.up import up_command
from tokq.workers.cli import worker_command
from service_stack import read_until_serving

COMMANDS = {
    "gateway": (gateway_command, (cfg.GatewayConfig, cfg.QueueConfig)),
    "worker": (worker_command, (cfg.WorkerConfig, cfg.QueueConfig)),
    "up": (up_command, (cfg.UpConfig, cfg.QueueConfig)),
}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_field_is_a_flag_whose_help_shows_its_env_var_and_default(name):
    command, classes = COMMANDS[name]
    out = " ".join(CliRunner().invoke(command, ["--help"]).output.split())  # unwrapped
    ctx = click.Context(command)
    records = dict(p.get_help_record(ctx) for p in command.params if p.get_help_record(ctx))
    for cls in classes:
        for f in dataclasses.fields(cls):
            flag = cfg.flag_of(f)
            decl = next((d for d in records if d.split()[0].rstrip(",") in (flag, f"{flag}/--no-{flag[2:]}")), None)
            assert decl, f"{name}: no {flag} for {cls.__name__}.{f.name}"
            help_text = " ".join(records[decl].split())
            assert f"env {cfg.env_var(f.name)};" in help_text and "default:" in help_text, help_text
            assert help_text in out  # what --help prints


def test_every_numeric_field_has_a_range():
    for cls in (cfg.QueueConfig, cfg.WorkerConfig, cfg.GatewayConfig, cfg.UpConfig):
        for f in dataclasses.fields(cls):
            if f.type in ("int", "float"):
                assert f.metadata.get("min") is not None, f"{cls.__name__}.{f.name} has no range"


@pytest.mark.parametrize("name,args,env,needle", [
    ("gateway", ["--lease-ms", "0"], {}, "lease_ms=0 is out of range, must be 100..3600000 "
                                         "(flag --lease-ms, env TOKQ_LEASE_MS)"),
    ("worker", ["--heartbeat-ms", "-5"], {}, "heartbeat_ms=-5 is out of range"),
    ("up", [], {"TOKQ_PORT": "70000"}, "port=70000 is out of range, must be 0..65535"),
    ("gateway", [], {"TOKQ_MAX_ATTEMPTS": "0"}, "env TOKQ_MAX_ATTEMPTS"),
    ("gateway", ["--tls-cert", "a.pem"], {}, "tls_cert and tls_key go together"),
    ("worker", [], {"TOKQ_LEASE_MS": "soon"}, "TOKQ_LEASE_MS: expected int, got 'soon'"),
    ("worker", ["--attn-backend", "bogus"], {}, "'bogus' is not one of"),
    ("gateway", ["--lease-msx", "500"], {}, "No such option '--lease-msx'. Did you mean '--lease-ms'?"),
])
def test_a_bad_value_is_one_line_and_exit_status_2(name, args, env, needle):
    env = {**os.environ, **env, "PYTHONWARNINGS": "ignore"}
    run = subprocess.run([sys.executable, "-m", "tokq.cli", name, *args], capture_output=True,
                         text=True, env=env, timeout=120)
    assert run.returncode == 2, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and needle in errors[0], run.stderr
    assert "Traceback" not in run.stderr
    # as the README says: click's Usage and Try lines, then the one Error line (`python -m tokq.cli`
    # is the program's name here, `tokq` when installed)
    usage, try_help, error = [line for line in run.stderr.splitlines() if line.strip()]
    assert usage.startswith("Usage: ") and usage.endswith(f" {name} [OPTIONS]"), run.stderr
    assert try_help.startswith("Try '") and try_help.endswith(f" {name} --help' for help."), run.stderr
    assert error == errors[0]


def test_the_attention_backends_a_flag_takes_are_the_workers():
    from tokq.workers import attention

    assert cfg.ATTN_BACKENDS == ("auto", *attention.BACKENDS)


def test_flags_beat_env_vars_beat_defaults():
    conf = cfg.load(cfg.QueueConfig, {"lookahead": 0}, env={"TOKQ_LEASE_MS": "1500", "TOKQ_LOOKAHEAD": "9"})
    assert (conf.lease_ms, conf.lookahead, conf.max_attempts) == (1500, 0, 3)
    keys = cfg.load(cfg.GatewayConfig, {"api_keys": ()}, env={"TOKQ_API_KEYS": "a, b"})
    assert keys.api_keys == ("a", "b")  # an unused repeatable flag leaves the env value
    assert cfg.load(cfg.GatewayConfig, {"reflection": None}, env={"TOKQ_REFLECTION": "off"}).reflection is False


@pytest.mark.slow
def test_tokq_up_with_a_redis_url_starts_no_redis_and_honours_tokq_env(redis_server, redis_url):
    from tokq import Client
    from tokq.redis.embedded import free_port

    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKQ_PORT": str(port), "TOKQ_HOST": "127.0.0.1",
           "TOKQ_DEVICE": "cpu", "TOKQ_METRICS_PORT": "0", "TOKQ_HTTP_PORT": "0", "TOKQ_LEASE_MS": "4321",
           "TOKQ_LATENCY_GOAL_MS": "1234", "TOKQ_LEASE_MSS": "1"}
    env.pop("TOKQ_REDIS_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "tokq.cli", "up", "--redis-url", redis_url],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    try:
        lines += read_until_serving(proc)
        text = "".join(lines)
        assert f"127.0.0.1:{port}" in text and "(embedded" not in text
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                  text=True).stdout.split()
        cmdlines = [open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0") for pid in children]
        assert len(cmdlines) == 2 and all(b"tokq.cli" in c for c in cmdlines)  # gateway + worker
        worker = next(c for c in cmdlines if b"worker" in c)
        assert worker[worker.index(b"--device") + 1] == b"cpu"
        assert worker[worker.index(b"--latency-goal-ms") + 1] == b"1234"
        # on a Redis other hosts may share, its worker ids name this host (every host's were up-0)
        import socket
        assert worker[worker.index(b"--worker-id") + 1] == f"{socket.gethostname()}-up-0".encode()
        assert redis_server.password.encode() not in b" ".join(b" ".join(c) for c in cmdlines)
        for pid in children:  # the queue settings up resolved reach every child
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            assert b"TOKQ_LEASE_MS=4321" in environ and f"TOKQ_REDIS_URL={redis_url}".encode() in environ
            assert not any(e.startswith(b"TOKQ_LEASE_MSS=") for e in environ)  # warned by up, not each child
        assert text.count("TOKQ_LEASE_MSS is not a tokq setting") == 1
        with Client(f"127.0.0.1:{port}") as client:
            assert client.embed(["up honours TOKQ_*"], timeout=60).shape == (1, 384)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_the_docker_image_listens_on_every_interface():
    from pathlib import Path

    dockerfile = (Path(__file__).parents[2] / "deploy" / "Dockerfile").read_text()
    env = dict(line.strip().rstrip("\\").strip().split("=", 1) for line in
               dockerfile.split("\nENV ", 1)[1].split("\n\n")[0].splitlines() if "=" in line)
    assert env["TOKQ_HOST"] == "0.0.0.0" and 'CMD ["tokq", "up"]' in dockerfile
    assert cfg.load(cfg.UpConfig, env=env).host == "0.0.0.0"


def test_tokq_up_takes_its_gateway_processes_from_the_environment_and_bounds_them():
    assert cfg.load(cfg.UpConfig, env={}).gateway_procs == 0  # auto (tokq.up.auto_gateway_procs)
    assert cfg.load(cfg.UpConfig, env={"TOKQ_GATEWAY_PROCS": "4"}).gateway_procs == 4
    for bad in ("-1", "65"):
        with pytest.raises(cfg.ConfigError):
            cfg.load(cfg.UpConfig, env={"TOKQ_GATEWAY_PROCS": bad})
    # every metrics port tokq up may hand out (64 gateway processes, then 256 workers) is a port
    top = cfg.load(cfg.UpConfig, env={"TOKQ_METRICS_PORT": str(65_535 - 64 - 256)}).metrics_port
    assert top + 64 + 255 <= 65_535
    with pytest.raises(cfg.ConfigError):
        cfg.load(cfg.UpConfig, env={"TOKQ_METRICS_PORT": str(65_535 - 64 - 255)})


def test_tokq_up_chooses_one_gateway_process_for_cpu_workers_and_more_for_gpu_workers():
    from tokq.host import usable_cpus
    from tokq.up import auto_gateway_procs, cuda_present, threads_per_worker

    def no_cuda():
        return False

    def cuda():
        return True

    assert auto_gateway_procs("cpu", 64, has_cuda=cuda) == 1  # CPU workers need the cores
    assert auto_gateway_procs("auto", 16, has_cuda=no_cuda) == 1
    # GPU workers: every CPU the worker and Redis leave (the rule: tests/cli/test_gateway_sizing.py)
    assert auto_gateway_procs("auto", 16, has_cuda=cuda) == 14
    assert [auto_gateway_procs("cuda:1", n, has_cuda=no_cuda) for n in (2, 8, 12, 64)] == [1, 6, 10, 62]
    assert 1 <= usable_cpus() <= (os.cpu_count() or 1)  # this process's share, as a container's
    # CPU workers' threads: the CPUs but one (the gateway's and Redis's), split, at least one each
    assert [threads_per_worker(1, n) for n in (1, 2, 16)] == [1, 1, 15]
    assert [threads_per_worker(w, 9) for w in (1, 2, 3, 16)] == [8, 4, 2, 1]
    if not any(name.startswith("nvidia") for name in os.listdir("/dev")):
        assert cuda_present() is False  # answered without starting torch


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "CPU", "cpu:0"])
def test_a_misspelled_device_is_a_usage_error_before_torch_loads(device):
    for cls in (cfg.WorkerConfig, cfg.UpConfig):
        with pytest.raises(cfg.ConfigError, match="device=.*is not auto | cpu | cuda | cuda:N"):
            cfg.load(cls, {"device": device}, env={})
    assert cfg.load(cfg.WorkerConfig, {"device": "cuda:3"}, env={}).device == "cuda:3"


def test_a_worker_that_cannot_load_its_model_says_why_in_one_line():
    result = CliRunner().invoke(worker_command, ["--model", "/nonexistent/model", "--redis-url",
                                                 "redis://127.0.0.1:1/0"])
    assert result.exit_code == 1 and not isinstance(result.exception, ValueError | FileNotFoundError)
    assert "Error: model '/nonexistent/model' is neither" in result.output
    check = CliRunner().invoke(worker_command, ["--check", "--model", "/nonexistent/model"])
    assert check.exit_code == 1 and not isinstance(check.exception, ValueError | FileNotFoundError)
    assert "Error: model '/nonexistent/model' is neither" in check.output


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_the_tokq_worker_script_takes_h_for_help_as_tokq_worker_does(flag):
    # tokq-worker runs tokq.workers.cli:main (pyproject's [project.scripts]), outside the tokq group
    run = subprocess.run([sys.executable, "-c", "from tokq.workers.cli import main; main()", flag],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("Usage: tokq-worker [OPTIONS]") and "--worker-id" in run.stdout


def _click_envvars(command: click.Command, ctx: click.Context | None = None) -> set[str]:
    names = {p.envvar for p in command.params if isinstance(p.envvar, str)}
    if isinstance(command, click.Group):
        ctx = click.Context(command, parent=ctx)
        for sub in command.list_commands(ctx):
            names |= _click_envvars(command.get_command(ctx, sub), ctx)
    return names


def test_every_tokq_variable_a_command_reads_is_known():
    from tokq.cli import main

    declared = _click_envvars(main) | _click_envvars(worker_command)
    assert {n for n in declared if n.startswith("TOKQ_")} <= cfg.known_env()
    assert {"TOKQ_LATENCY_GOAL_MS", "TOKQ_CACHE_DIR", "TOKQ_TARGET"} <= cfg.known_env()


def test_a_misspelled_tokq_variable_is_warned_with_the_names_it_is_close_to():
    env = {"TOKQ_LATENCY_GOL_MS": "3", "TOKQ_LEASE_MS": "500", "TOKQ_NOTHING_LIKE_IT": "1", "PATH": "/"}
    assert cfg.unknown_env(env) == {"TOKQ_LATENCY_GOL_MS": ["TOKQ_LATENCY_GOAL_MS", "TOKQ_REPLY_TTL_MS"],
                                    "TOKQ_NOTHING_LIKE_IT": []}
    out = subprocess.run([sys.executable, "-m", "tokq.cli", "embed", "--help"], capture_output=True,
                         text=True, env={**os.environ, **env}, check=True)
    assert "warning: TOKQ_LATENCY_GOL_MS is not a tokq setting and is ignored; did you mean " \
           "TOKQ_LATENCY_GOAL_MS" in out.stderr
    assert "TOKQ_NOTHING_LIKE_IT is not a tokq setting and is ignored\n" in out.stderr
    assert "TOKQ_LEASE_MS" not in out.stderr


def test_a_worker_refuses_a_metrics_port_another_process_listens_on():
    # One line before the model loads (it was a traceback once the model had loaded).
    import socket

    from click.testing import CliRunner

    from tokq.workers.cli import worker_command

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        args = ["--metrics-port", str(port), "--metrics-host", "127.0.0.1", "--redis-url", "redis://127.0.0.1:1/0"]
        result = CliRunner().invoke(worker_command, args)
    assert result.exit_code == 2, result.output
    assert f"metrics port {port} on 127.0.0.1 already in use" in result.output
