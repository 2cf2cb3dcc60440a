"""`tokq up`: the whole service on one machine — an embedded Redis (none with --redis-url), the
gateway (one process or --gateway-procs), N workers — as child processes supervised here. Ctrl-C
(or SIGTERM, SIGHUP) stops them all; children, the embedded Redis included, also die with this
process (PR_SET_PDEATHSIG), and the gateway's own processes with it, so nothing is left behind."""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import click

from tokq import config as cfg
from tokq.address import host_port, local_host, ports_taken
from tokq.processes import ExitedDuringStartup, NotHealthy, wait_for_health
from tokq.host import usable_cpus
from tokq.model.info import ModelInfo
from tokq.model.source import model_errors_as_one_line
from tokq.processes import stop_all, supervised_child
from tokq.redis.embedded import EmbeddedRedis, free_port, redact_url

def _spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    # Secrets (the Redis URL's password, API keys) travel in the environment, never in argv:
    # any local user can read a process's command line with `ps`.
    return subprocess.Popen([sys.executable, "-m", "tokq.cli", *args], env=env,
                            preexec_fn=supervised_child(os.getpid()))


# Beside the gateway, a GPU worker's host side (launching kernels, moving batches) keeps about a
# core busy, and the embedded Redis one (it serves commands on one thread).
GPU_WORKER_CPUS = 1
REDIS_CPUS = 1
MAX_GATEWAY_PROCS = 64  # UpConfig.gateway_procs's range
RESTART_STABLE_S = 60.0  # a worker that ran this long before it died is started again at once
RESTART_MAX_S = 30.0
CUDA_CHECK_TIMEOUT_S = 60


def up_worker_id(i: int, *, shared: bool) -> str:
    """tokq up's worker ``i``'s id. ``shared``: on a --redis-url, which other hosts' tokq up may
    share, so the host name keeps their workers' ids (heartbeat keys, metric labels) apart."""
    return f"{socket.gethostname()}-up-{i}" if shared else f"up-{i}"


class StopRequest:
    """What a stop signal (Ctrl-C, SIGTERM, SIGHUP) does to `tokq up`: the first raises
    KeyboardInterrupt, later ones are ignored so stopping is not cut short. Loops also call
    ``check``: Python swallows a KeyboardInterrupt raised inside a finalizer."""

    def __init__(self) -> None:
        self.asked = False

    def handler(self, _sig=None, _frame=None) -> None:
        if self.asked:
            return
        self.asked = True
        raise KeyboardInterrupt

    def check(self) -> None:
        if self.asked:
            raise KeyboardInterrupt


class RestartBackoff:
    """When to start a dead worker again: at once after a long run, else after a wait that doubles
    with each quick death (1, 2, 4, ... s, at most RESTART_MAX_S), so a worker that dies at start
    does not reload its model in a tight loop."""

    def __init__(self, now: float) -> None:
        self.started_at = now
        self.delay = 0.0
        self.due: float | None = None  # when to start it again, once found dead

    def died(self, now: float) -> float:
        """Found dead at ``now``: the wait before its restart."""
        quick = now - self.started_at < RESTART_STABLE_S
        self.delay = min(max(1.0, 2 * self.delay), RESTART_MAX_S) if quick else 0.0
        self.due = now + self.delay
        return self.delay

    def ready(self, now: float) -> bool:
        return self.due is not None and now >= self.due

    def restarted(self, now: float) -> None:
        self.started_at, self.due = now, None


def cuda_present() -> bool:
    """Whether the workers' ``--device auto`` will find CUDA: no NVIDIA device node, no; else torch
    answers in a short-lived process, so tokq up never holds torch (a wedged driver: no, after a minute)."""
    try:
        if not any(name.startswith("nvidia") for name in os.listdir("/dev")):
            return False
    except OSError:
        return False
    check = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"
    try:
        return subprocess.run([sys.executable, "-c", check], capture_output=True,
                              timeout=CUDA_CHECK_TIMEOUT_S).returncode == 0
    except subprocess.TimeoutExpired:
        click.echo(f"tokq up: asking torch for CUDA took over {CUDA_CHECK_TIMEOUT_S} s; one gateway process",
                   err=True)
        return False


@dataclasses.dataclass(frozen=True)
class FrontEnd:
    """The gateway's share of the host: its processes and each one's tokenizer threads."""

    procs: int
    tokenize_threads: int


def size_front_end(cpus: int, workers: int, *, on_gpu: bool, worker_threads: int = 1,
                   embedded_redis: bool = True, procs: int = 0) -> FrontEnd:
    """The gateway takes the CPUs that the workers (GPU: a core each; CPU: their torch threads) and
    the embedded Redis (a core) leave: one process per CPU left with GPU workers, one with CPU
    workers (inference is their bottleneck), its processes tokenizing on those CPUs, split between
    them; at least one of each. ``procs``: the operator's count (0: chosen here)."""
    used = workers * (GPU_WORKER_CPUS if on_gpu else worker_threads) + (REDIS_CPUS if embedded_redis else 0)
    left = max(1, cpus - used)
    procs = procs or (min(left, MAX_GATEWAY_PROCS) if on_gpu else 1)
    return FrontEnd(procs, max(1, left // procs))


def workers_on_gpu(device: str, has_cuda=None) -> bool:
    """Whether workers started with ``--device`` run on a GPU (auto: whether CUDA is there)."""
    return device.startswith("cuda") or (device == "auto" and (has_cuda or cuda_present)())


def auto_gateway_procs(device: str, cpus: int | None = None, has_cuda=None, *, workers: int = 1,
                       embedded_redis: bool = True) -> int:
    """`--gateway-procs 0`: ``size_front_end``'s processes beside ``workers`` workers on ``device``."""
    cpus = cpus or usable_cpus()
    return size_front_end(cpus, workers, on_gpu=workers_on_gpu(device, has_cuda),
                          worker_threads=threads_per_worker(workers, cpus), embedded_redis=embedded_redis).procs


def _api_keys(conf: cfg.UpConfig) -> dict[str, str]:
    """The gateway's environment for ``conf``'s API keys (secrets travel there, not in argv),
    checked as the gateway will check them."""
    from tokq.gateway.auth import ApiKeys, client_key_warning

    try:
        keys = ApiKeys.from_config(cfg.GatewayConfig(api_keys=conf.api_keys, api_key_file=conf.api_key_file))
    except cfg.ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    if warning := client_key_warning(keys is not None, who="tokq up"):
        click.echo(warning, err=True)
    return {cfg.env_var("api_keys"): ",".join(conf.api_keys)} if conf.api_keys else {}


def _check_distinct_ports(conf: cfg.UpConfig, num_gateways: int) -> None:
    """One line for one port given to two settings, the metrics ports counted as handed out:
    gateway process j's at --metrics-port + j, then worker i's."""
    gateways = "the gateway's metrics" if num_gateways == 1 else "gateway process {}'s metrics"
    metrics = [*(("metrics_port", conf.metrics_port, j, gateways.format(j)) for j in range(num_gateways)),
               *(("metrics_port", conf.metrics_port, num_gateways + i, f"worker {i}'s metrics")
                 for i in range(conf.workers))]
    try:
        cfg.check_distinct_ports([("port", conf.port, 0, ""), ("http_port", conf.http_port, 0, ""),
                                  *metrics])
    except cfg.ConfigError as exc:
        raise click.UsageError(str(exc)) from None


def _keep_up(embedded: EmbeddedRedis | None) -> None:
    """Start the embedded Redis again if it died (its queue is lost; calls in flight fail
    retryable), or stop with one line if it cannot start."""
    if embedded and not embedded.running:
        click.echo(f"the embedded Redis exited; restarting it on port {embedded.port}", err=True)
        try:
            embedded.restart()
        except (OSError, RuntimeError, TimeoutError) as exc:
            raise click.ClickException(f"the embedded Redis did not start again: {exc}") from None


def _tls_credentials(conf: cfg.UpConfig):
    """The credentials the readiness check dials a TLS gateway with: --tls-ca (default: the
    certificate itself) and, under mutual TLS, the client certificate; None for plaintext. A bad
    file is one line here, before anything starts."""
    if not conf.tls_cert:
        return None
    import grpc

    def read(name: str) -> bytes | None:
        if not (path := getattr(conf, name)):
            return None
        from tokq.client import read_pem

        try:
            return read_pem(path)
        except ValueError as exc:
            raise click.ClickException(f"{name} {exc} (flag --{name.replace('_', '-')}, "
                                       f"env {cfg.env_var(name)})") from None

    # every file read, the gateway's own too: it would find them unreadable after Redis started
    files = {name: read(name) for name in ("tls_cert", "tls_key", "tls_client_ca", "tls_ca",
                                           "client_tls_cert", "client_tls_key")}
    mutual = bool(conf.tls_client_ca)
    return grpc.ssl_channel_credentials(files["tls_ca"] or files["tls_cert"],
                                        private_key=files["client_tls_key"] if mutual else None,
                                        certificate_chain=files["client_tls_cert"] if mutual else None)


def _wait_ready(target: str, procs: list[subprocess.Popen], embedded: EmbeddedRedis | None = None,
                report_every_s: float = 30, check_every_s: float = 2, credentials=None,
                stop: StopRequest | None = None) -> None:
    """Wait for the gateway to report ready for as long as every process lives (a large model can
    take minutes), saying every ``report_every_s`` what it waits for. The embedded Redis is kept up
    meanwhile. ``credentials``: the gateway serves TLS."""
    started = last_report = time.monotonic()
    while True:
        try:
            wait_for_health(target, procs, check_every_s, credentials=credentials)
            return
        except ExitedDuringStartup:
            raise click.ClickException("a tokq process exited during start-up (see its log above)") from None
        except NotHealthy as exc:
            if stop:
                stop.check()
            _keep_up(embedded)
            if time.monotonic() - last_report >= report_every_s:
                last_report = time.monotonic()
                why = (f"; the last TLS health check said: {exc.last_error}"
                       if credentials and exc.last_error else "")
                click.echo(f"tokq up: not ready after {last_report - started:.0f} s: no worker ready yet "
                           "(loading the model and warming up, or not reaching Redis: see the log above; "
                           f"Ctrl-C to give up){why}", err=True)


def _check_ports(ports: list[tuple[str, str, int]]) -> None:
    """One line, before anything starts, for a port another process (another `tokq up`) listens
    on: the gateway's and workers' own checks come after Redis started. A port left in
    TIME_WAIT by the last run is free."""
    if busy := ports_taken(ports):
        raise click.ClickException(f"{busy} already in use (another tokq up?): choose other --port / "
                                   "--http-port / --metrics-port, or stop that process")


def _client_tls(conf: cfg.UpConfig, ca_flag: str, cert_flag: str, key_flag: str) -> str:
    """A client's TLS flags in the lines tokq up prints ("" for plaintext), the files absolute:
    the lines may be run from another directory."""
    if not conf.tls_cert:
        return ""

    def path(name: str) -> str:
        return shlex.quote(str(Path(getattr(conf, name)).resolve()))

    out = f" {ca_flag} {path('tls_ca' if conf.tls_ca else 'tls_cert')}"
    if conf.tls_client_ca:
        out += f" {cert_flag} {path('client_tls_cert')} {key_flag} {path('client_tls_key')}"
    return out


def tokq_command() -> str:
    """How a shell here runs this tokq: `tokq` where PATH finds it, else its path (`make run`
    starts .venv/bin/tokq, whose directory a user's shell rarely has on its PATH)."""
    script = Path(sys.executable).parent / "tokq"
    found = shutil.which("tokq")
    if not script.exists() or (found and Path(found).resolve() == script.resolve()):
        return "tokq"
    return shlex.quote(str(script.absolute()))


def threads_per_worker(num_workers: int, cpus: int | None = None) -> int:
    """Torch threads for each of ``num_workers`` CPU workers beside one gateway and Redis: the
    usable CPUs but one (left to those two), split between the workers, at least one each.
    `tokq bench service` gives its baselines' models the same number."""
    return max(1, (max(cpus or usable_cpus(), 2) - 1) // num_workers)


def _worker_threads(num_workers: int, cpus: int) -> int:
    """TOKQ_THREADS where set and not 0, else ``threads_per_worker``: 0, torch's default, would
    give each worker every core."""
    name = cfg.env_var("threads")
    if name not in os.environ:
        return threads_per_worker(num_workers, cpus)
    try:
        threads = cfg.load(cfg.WorkerConfig, {}, env={name: os.environ[name]}).threads
    except cfg.ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    return threads or threads_per_worker(num_workers, cpus)


@click.command("up")
@cfg.click_options(cfg.UpConfig, cfg.QueueConfig)
def up_command(**values) -> None:
    """Start Redis, the gateway and workers; stop everything on Ctrl-C."""
    up_values, queue_values = cfg.split(values, cfg.UpConfig, cfg.QueueConfig)
    conf = cfg.load_or_exit(cfg.UpConfig, up_values)
    queue_conf = cfg.load_or_exit(cfg.QueueConfig, queue_values)
    auth = _api_keys(conf)  # a missing or empty key file stops here, before anything starts
    credentials = _tls_credentials(conf)  # and so does a certificate file
    with model_errors_as_one_line():  # a missing model too: one line here, not a traceback per child
        ModelInfo.load(conf.model or None, name=conf.served_model_name or None,
                       revision=conf.revision or None).require_tokenizer()  # its gateway tokenizes
    cpus = usable_cpus()
    host, num_workers, metrics_port = conf.host, conf.workers, conf.metrics_port
    threads = _worker_threads(num_workers, cpus)
    front = size_front_end(cpus, num_workers, on_gpu=workers_on_gpu(conf.device), worker_threads=threads,
                           embedded_redis=not conf.redis_url, procs=conf.gateway_procs)  # before anything starts
    num_gateways = front.procs
    # TOKQ_TOKENIZE_THREADS, where set, reaches the gateway in its environment and wins
    tokenize = ([] if cfg.env_var("tokenize_threads") in os.environ
                else ["--tokenize-threads", str(front.tokenize_threads)])
    _check_distinct_ports(conf, num_gateways)
    metrics_ports = range(metrics_port, metrics_port + num_gateways + num_workers) if metrics_port else ()
    port = conf.port or free_port(host, taken=frozenset({conf.http_port, *metrics_ports}))
    _check_ports([("gRPC", host, port), ("HTTP", host, conf.http_port),
                  *(("metrics", host, p) for p in metrics_ports)])
    if conf.redis_url:  # a URL or cluster setting that cannot work: one line, before anything starts
        from tokq.redis.connection import check_redis_or_exit

        check_redis_or_exit(conf.redis_url, conf.redis_cluster)
    elif conf.redis_cluster == "yes":
        raise click.UsageError("--redis-cluster yes (TOKQ_REDIS_CLUSTER) needs --redis-url: the embedded "
                               "Redis is a standalone server")
    embedded = None
    redis_url = conf.redis_url
    if not redis_url:
        try:  # one line, and its directory (the password file) removed, when the server cannot start
            embedded = EmbeddedRedis(binary=conf.redis_server or None, with_parent=True)
            embedded.start()
        except BaseException as exc:  # Ctrl-C meanwhile too: the directory holds the password
            if embedded:
                embedded.close()
            if isinstance(exc, (OSError, RuntimeError, TimeoutError)):
                raise click.ClickException(f"the embedded Redis did not start: {exc}") from None
            raise
        redis_url = embedded.url
    # Every setting resolved here reaches the children explicitly: what this process was told
    # (flags or TOKQ_*) is what they run with.
    unknown = cfg.unknown_env()  # warned once, here: not again by each child
    # TOKQ_API_KEY too (the client's, warned about above): no child reads it
    env = {**{k: v for k, v in os.environ.items() if k not in unknown and k != "TOKQ_API_KEY"},
           cfg.env_var("redis_url"): redis_url, cfg.env_var("redis_cluster"): conf.redis_cluster, **auth,
           **{cfg.env_var(f.name): str(getattr(queue_conf, f.name))
              for f in dataclasses.fields(queue_conf)}}
    common = [*(["--model", conf.model] if conf.model else []),
              *(["--revision", conf.revision] if conf.revision else []),
              *(["--served-model-name", conf.served_model_name] if conf.served_model_name else [])]
    procs: list[subprocess.Popen] = []

    def worker_args(i: int) -> list[str]:
        worker_id = up_worker_id(i, shared=embedded is None)
        args = ["worker", *common, "--device", conf.device, "--dtype", conf.dtype, "--worker-id", worker_id,
                "--threads", str(threads), "--token-budget", str(conf.token_budget),
                "--latency-goal-ms", str(conf.latency_goal_ms),
                "--metrics-port", str(metrics_port + num_gateways + i if metrics_port else 0),
                "--metrics-host", host]
        return args

    stop = StopRequest()
    # SIGHUP (the terminal closed) too, unless ignored: nohup, or a background job's SIGINT.
    stops = [signal.SIGTERM, *(sig for sig in (signal.SIGINT, signal.SIGHUP)
                               if signal.getsignal(sig) is not signal.SIG_IGN)]
    for sig in stops:
        signal.signal(sig, stop.handler)
    try:
        gw_args = ["gateway", *common, "--host", host, "--port", str(port), "--procs", str(num_gateways), *tokenize,
                   "--metrics-port", str(metrics_port), "--http-port", str(conf.http_port),
                   *(["--api-key-file", str(Path(conf.api_key_file).resolve())] if conf.api_key_file else []),
                   *(arg for name in ("tls_cert", "tls_key", "tls_client_ca") if getattr(conf, name)
                     for arg in (f"--{name.replace('_', '-')}", str(Path(getattr(conf, name)).resolve())))]
        procs.append(_spawn(gw_args, env))
        workers = [_spawn(worker_args(i), env) for i in range(num_workers)]
        restarts = [RestartBackoff(time.monotonic()) for _ in workers]
        procs += workers
        local = local_host(host)  # what a client here dials: loopback for a wildcard --host
        target = host_port(local, port)
        _wait_ready(target, procs, embedded, credentials=credentials, stop=stop)
        tls = ("mutual TLS, " if conf.tls_client_ca else "TLS, ") if credentials else ""
        click.echo(f"\ntokq is up: gRPC tokq.v1.Embedder on {host_port(host, port)} ({tls}health and "
                   f"reflection on), {num_gateways} gateway process(es), {num_workers} worker(s)")
        if conf.http_port:
            http_url = f"http{'s' if credentials else ''}://{host_port(local, conf.http_port)}/v1/embeddings"
            click.echo(f"  HTTP:    {http_url} (OpenAI-compatible)")
        click.echo(f"  Redis:   {redact_url(redis_url)}" + (
            " (embedded, loopback, generated password)" if embedded else ""))
        if metrics_port:
            gateways = ", ".join(f":{metrics_port + j}" for j in range(1, num_gateways))
            ports = ", ".join(f"worker {i} :{metrics_port + num_gateways + i}" for i in range(num_workers))
            click.echo(f"  metrics: gateway http://{host_port(local, metrics_port)}/metrics"
                       f"{f' (and {gateways})' if gateways else ''}, {ports}")
        # Quoted where a shell would glob them (an IPv6 target's brackets: zsh stops at "no matches").
        shell_target = shlex.quote(target)
        keyed = bool(conf.api_keys or conf.api_key_file)
        header = ' -H "authorization: Bearer $TOKQ_API_KEY"' if keyed else ""
        if keyed:
            click.echo("  auth:    API keys required (set TOKQ_API_KEY to one for these lines)")
        embed_tls = _client_tls(conf, "--tls-ca", "--tls-cert", "--tls-key")
        click.echo(f"  try:     {tokq_command()} embed --target {shell_target}{embed_tls} \"hello world\"")
        grpcurl_tls = _client_tls(conf, "-cacert", "-cert", "-key").lstrip() or "-plaintext"
        click.echo(f"           grpcurl {grpcurl_tls}{header} -d '{{\"inputs\": [\"hello\"]}}' "
                   f"{shell_target} tokq.v1.Embedder/Embed")
        if conf.http_port:
            curl_tls = _client_tls(conf, "--cacert", "--cert", "--key")
            click.echo(f"           curl {shlex.quote(http_url)}{curl_tls}{header} "
                       "-H 'Content-Type: application/json' "
                       "-d '{\"input\": \"hello\"}'")
        click.echo("Ctrl-C stops everything.\n", nl=True)
        while True:
            stop.check()
            if procs[0].poll() is not None:
                raise click.ClickException(f"the gateway exited ({procs[0].returncode})")
            for i, proc in enumerate(workers):
                if proc.poll() is not None:
                    now, again = time.monotonic(), restarts[i]
                    if again.due is None:
                        wait = again.died(now)
                        click.echo(f"worker {i} exited ({proc.returncode}); restarting it"
                                   + (f" in {wait:.0f} s" if wait else ""), err=True)
                    if again.ready(now):
                        workers[i] = procs[1 + i] = _spawn(worker_args(i), env)
                        again.restarted(now)
            _keep_up(embedded)
            time.sleep(0.5)
    except KeyboardInterrupt:
        click.echo("stopping tokq ...", err=True)
    finally:
        for sig in stops:  # as after a stop signal: the gateway's exit ends up here without one
            signal.signal(sig, signal.SIG_IGN)
        stop_all(procs)
        if embedded:
            embedded.close()
