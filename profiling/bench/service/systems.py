"""The systems `tokq bench service` measures, each started as its own processes as an operator would
(`tokq up` for tokq, `python -m tokq.profiling.bench.baselines` for a baseline, `infinity_emb`), the
senders the load generator drives them with, and tokq's per-batch figures (worker metrics, queue
counters) read around each run."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import subprocess
import sys
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tokq.client import AsyncClient, TokqError
from tokq.profiling import harness
from tokq.profiling.bench.loadgen import Reply
from tokq.profiling.bench.proc_cpu import children, cmdline, descendants

MODEL = "all-MiniLM-L6-v2"  # the name the baselines and Infinity serve


@dataclass(frozen=True)
class SystemSpec:
    name: str
    kind: str  # "tokq" | "one-at-a-time" | "onnx-one-at-a-time" | "padded-batching" | "infinity"
    token_budget: int = 0  # tokq: tokens per batch (0: the worker's default, as `tokq up` runs it)
    lookahead: int | None = None  # tokq: entries a claim may pass over (0 = strict FIFO)
    max_batch_size: int = 64  # padded-batching: inputs per batch
    max_wait_ms: float = 10.0  # padded-batching
    infinity_bin: str = ""  # infinity: the `infinity_emb` executable (its own virtualenv)
    engine: str = "torch"  # infinity: torch | optimum (ONNX Runtime)
    onnx_dir: str = ""  # onnx-one-at-a-time, infinity optimum: the ONNX export
    model: str = ""  # tokq and the sentence-transformers baselines: model directory ("" = bundled)
    device: str = "cpu"  # tokq and the sentence-transformers baselines
    gateway_procs: int = 0  # tokq: gateway processes (`tokq up --gateway-procs`; 0: its own choice)
    worker_threads: int = 0  # tokq: the worker's torch threads (TOKQ_THREADS; 0: `tokq up`'s choice)

    def label(self, budget: int = 0, source: str = "") -> str:
        """The name; ``{budget}`` in it becomes the budget the worker serves at once started."""
        served = f"budget {budget}" + (", fitted at start" if source == "fitted" else "") if budget else "its own budget"
        return self.name.replace("{budget}", served)

    def describe(self) -> dict:
        keep = {"tokq": ("token_budget", "lookahead", "gateway_procs", "worker_threads"), "padded-batching": ("max_batch_size", "max_wait_ms"),
                "infinity": ("max_batch_size", "infinity_bin", "engine")}
        d = asdict(self)
        return {"name": self.name, "kind": self.kind, **{k: d[k] for k in keep.get(self.kind, ())}}


class GrpcSender:
    """One Embed call per request through tokq.AsyncClient over ``connections`` connections, each
    call to the gateway process with the fewest in flight (one channel would send every call down
    one connection, to one process of `tokq up --gateway-procs N`). Errors come back as status names."""

    def __init__(self, target: str, timeout_s: float, connections: int = 4) -> None:
        self._client, self.timeout_s = AsyncClient(target, connections=connections), timeout_s

    async def __call__(self, texts) -> Reply:
        try:
            resp = await self._client.embed_full(list(texts), truncate=True, timeout=self.timeout_s)
        except TokqError as exc:
            return Reply(exc.code.name)
        return Reply("OK", resp.timing["queue_ms"], resp.timing["inference_ms"])

    async def close(self) -> None:
        await self._client.close()


class HttpSender:
    """One OpenAI-style POST /embeddings per request (Infinity's API) over pooled keep-alive
    connections; a timeout reads as DEADLINE_EXCEEDED, an HTTP error as HTTP_<code>."""

    def __init__(self, base_url: str, model: str, timeout_s: float) -> None:
        import httpx

        self._httpx = httpx
        # httpx's timeouts are per phase; the deadline is enforced whole below.
        self._client = httpx.AsyncClient(base_url=base_url, timeout=timeout_s + 1,
                                         limits=httpx.Limits(max_connections=256, max_keepalive_connections=256))
        self.model, self.timeout_s = model, timeout_s

    async def __call__(self, texts) -> Reply:
        try:
            resp = await asyncio.wait_for(self._client.post("/embeddings", json={"model": self.model,
                                                                               "input": list(texts)}), self.timeout_s)
        except (TimeoutError, self._httpx.TimeoutException):
            return Reply("DEADLINE_EXCEEDED")
        except self._httpx.TransportError:
            return Reply("UNAVAILABLE")
        if resp.status_code != 200:
            return Reply(f"HTTP_{resp.status_code}")
        return Reply("OK") if len(resp.json()["data"]) == len(texts) else Reply("INCOMPLETE")

    async def close(self) -> None:
        await self._client.aclose()


async def fetch_vectors(system: RunningSystem, texts: list[str], timeout_s: float = 60.0):
    """Each text's vector from ``system``, one single-input request per text (as the load sends
    them), all in flight at once; float32 [n, dim]."""
    import numpy as np

    if system.spec.kind == "infinity":
        import httpx

        async with httpx.AsyncClient(base_url=f"http://{system.target}", timeout=timeout_s) as client:
            async def one(text: str):
                resp = await client.post("/embeddings", json={"model": MODEL, "input": [text]})
                resp.raise_for_status()
                return resp.json()["data"][0]["embedding"]
            return np.asarray(await asyncio.gather(*(one(t) for t in texts)), dtype=np.float32)
    async with AsyncClient(system.target) as client:
        rows = await asyncio.gather(*(client.embed([t], truncate=True, timeout=timeout_s) for t in texts))
    return np.concatenate(rows).astype(np.float32)


def scrape(url: str) -> dict[str, float]:
    """A Prometheus page's samples summed by name, and by "name|reason" or "name|lane" where so labelled."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(urllib.request.urlopen(url, timeout=5).read().decode()):
        for s in family.samples:
            for key in {s.name, "|".join([s.name, *(s.labels[k] for k in ("reason", "lane") if k in s.labels)])}:
                out[key] = out.get(key, 0.0) + s.value
    return out


def min_cosine(got, want) -> float:
    import numpy as np

    return float(((got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))).min())


def sender_factory(system: RunningSystem, timeout_s: float):
    """What makes a sender for ``system``, picklable (a load-generator process makes its own)."""
    if system.spec.kind == "infinity":
        return functools.partial(HttpSender, f"http://{system.target}", MODEL, timeout_s)
    # at least one connection per gateway process, so every process can be reached
    return functools.partial(GrpcSender, system.target, timeout_s, connections=max(4, system.spec.gateway_procs))


class RunningSystem:
    def __init__(self, spec: SystemSpec, target: str, proc: subprocess.Popen, redis_server=None,
                 metrics_port: int = 0, queue: str = MODEL) -> None:
        self.spec, self.target, self.proc, self.queue = spec, target, proc, queue
        self.redis_server, self.metrics_port = redis_server, metrics_port
        self.token_budget, self.budget_source = 0, ""  # tokq: what its worker serves at, and why

    def process_roles(self) -> dict[str, list[int]]:
        """The system's processes by role, for their CPU time: tokq's gateway (every process),
        worker(s) and Redis; a baseline's server (with any children)."""
        if self.redis_server is None:
            return {"server": [self.proc.pid, *descendants(self.proc.pid)]}
        roles: dict[str, list[int]] = {"gateway": [], "worker": []}
        for child in children(self.proc.pid):  # tokq up's: each with its own processes below it
            args = cmdline(child)
            role = args[args.index("tokq.cli") + 1] if "tokq.cli" in args[:-1] else ""
            if role in roles:
                roles[role] += [child, *descendants(child)]
        return {**roles, "redis": [self.redis_server.pid] if self.redis_server.pid else []}

    def batch_snapshot(self) -> dict | None:
        """Cumulative batch counters of a tokq deployment (None for a baseline)."""
        if self.redis_server is None:
            return None
        import redis

        from tokq.queue.keys import QueueKeys

        client = redis.Redis.from_url(self.redis_server.url)
        try:
            counters = {k.decode(): int(v) for k, v in client.hgetall(QueueKeys(self.queue).counters).items()}
        finally:
            client.close()
        snap = {"batches_claimed": counters.get("batches", 0), "items_claimed": counters.get("claimed", 0)}
        names = {"forward_tokens": "tokq_worker_forward_tokens_total", "fill_sum": "tokq_worker_batch_fill_ratio_sum",
                 "fill_count": "tokq_worker_batch_fill_ratio_count",
                 "forward_s": "tokq_worker_forward_duration_seconds_sum",
                 "forward_count": "tokq_worker_forward_duration_seconds_count"}
        with contextlib.suppress(OSError):  # worker 0's metrics port follows the gateway processes' (tokq up's)
            values = scrape(f"http://127.0.0.1:{self.metrics_port + self.spec.gateway_procs}/metrics")
            snap.update({key: values[name] for key, name in names.items() if name in values})
            snap.update({"stop " + k.split("|")[1]: v for k, v in values.items()
                         if k.startswith("tokq_worker_claim_stops_total|")})
        return snap

    def lane_tokens(self) -> dict[str, float]:
        """Tokens queued per lane, from the lane gauges of the gateway process that exports them."""
        pages = [scrape(f"http://127.0.0.1:{self.metrics_port + i}/metrics") for i in range(self.spec.gateway_procs)]
        return {k.split("|")[1]: v for page in pages for k, v in page.items()
                if k.startswith("tokq_queue_lane_queued_tokens|")}

    def close(self) -> None:
        from tokq.processes import stop_all

        stop_all([self.proc], timeout_s=30)
        if self.redis_server:
            self.redis_server.close()


def batch_stats(before: dict | None, after: dict | None) -> dict | None:
    """Per-batch figures over one run, from two ``batch_snapshot``s."""
    if before is None or after is None:
        return None
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    if (batches := d.get("batches_claimed", 0)) <= 0:
        return {"num_batches": 0}
    stats = {"num_batches": batches, "items_per_batch": round(d["items_claimed"] / batches, 2)}
    if claims := sum(v for k, v in d.items() if k.startswith("stop ")):  # share of claims by stop reason
        stats["claim_stops"] = {k[5:]: round(v / claims, 3) for k, v in d.items() if k.startswith("stop ") and v}
    if (n := d.get("forward_count", 0)) > 0:
        stats.update(tokens_per_batch=round(d["forward_tokens"] / n, 1),
                     fill_ratio=round(d["fill_sum"] / max(d["fill_count"], 1), 3),
                     forward_ms=round(1000 * d["forward_s"] / n, 2))
    return stats


def start_system(spec: SystemSpec, *, threads: int = 0, log_path: str | None = None) -> RunningSystem:
    """Start ``spec`` and return once it serves (tokq: once its worker has warmed up). ``threads`` > 0
    caps the model process's intra-op threads (OMP_NUM_THREADS)."""
    from tokq.model.info import ModelInfo, bundled_model_path
    from tokq.processes import wait_for_health
    from tokq.redis.embedded import EmbeddedRedis, free_port, free_port_block

    port = free_port()
    target = f"127.0.0.1:{port}"
    threads = spec.worker_threads or threads
    extra = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)} if threads > 0 else {}
    extra.update({"TOKQ_THREADS": str(threads)} if spec.worker_threads else {})
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    redis_server, metrics_port, model_args = None, 0, ["--model", spec.model] if spec.model else []
    if spec.kind == "tokq":
        if not spec.gateway_procs:  # as tokq up chooses, said explicitly: the metrics ports follow from it
            from tokq.up import auto_gateway_procs

            spec = replace(spec, gateway_procs=auto_gateway_procs(spec.device))
        redis_server = EmbeddedRedis().start()
        metrics_port = free_port_block(spec.gateway_procs + 1)  # the gateways', then the worker's
        extra.update(TOKQ_REDIS_URL=redis_server.url, **({"TOKQ_LOOKAHEAD": str(spec.lookahead)}
                                                          if spec.lookahead is not None else {}))
        args = ["-m", "tokq.cli", "up", "--port", str(port), "--gateway-procs", str(spec.gateway_procs), "--workers", "1",
                "--device", spec.device, "--metrics-port", str(metrics_port), "--http-port", "0", *model_args,
                *(["--token-budget", str(spec.token_budget)] if spec.token_budget else [])]  # gRPC is what it measures
    elif spec.kind == "infinity":
        extra.update(INFINITY_ANONYMOUS_USAGE_STATS="0", DO_NOT_TRACK="1")
        if log_path:  # the ONNX engine caches its optimized model under the hub cache: keep it here
            extra["HF_HUB_CACHE"] = str(Path(log_path).parent / "hf-cache")
        # Mean pooling, as the model was trained (Infinity's ONNX engine defaults to CLS pooling). Its
        # ONNX engine is given the export as "." from inside it: optimum-onnx 0.1 looks an absolute
        # model.onnx path up as a name inside the directory, and fails.
        args = ["v2", "--model-id", "." if spec.engine == "optimum" else str(bundled_model_path()),
                "--served-model-name", MODEL, "--engine", spec.engine, "--pooling-method", "mean", "--device", "cpu",
                "--host", "127.0.0.1", "--port", str(port), "--batch-size", str(spec.max_batch_size),
                "--no-bettertransformer"]
    else:
        args = ["-m", "tokq.profiling.bench.baselines", "--kind", spec.kind, "--port", str(port), "--device", spec.device,
                "--max-batch-size", str(spec.max_batch_size), "--max-wait-ms", str(spec.max_wait_ms), *model_args,
                *(["--onnx-dir", spec.onnx_dir] if spec.onnx_dir else [])]
    proc = subprocess.Popen([spec.infinity_bin if spec.kind == "infinity" else sys.executable, *args],
                            env=harness.env(**extra), stdout=log, stderr=log,
                            cwd=spec.onnx_dir if spec.kind == "infinity" and spec.engine == "optimum" else None)
    queue = ModelInfo.load(spec.model or None).queue_name
    system = RunningSystem(spec, target, proc, redis_server, metrics_port, queue)
    try:
        if spec.kind == "infinity":
            def serving() -> bool:
                try:
                    return urllib.request.urlopen(f"http://{target}/health", timeout=1).status == 200
                except OSError:
                    return False
            harness.wait_until(serving, f"{target} serving", [proc], poll_s=0.3)
        else:
            wait_for_health(target, [proc], harness.START_TIMEOUT_S)
        if redis_server:  # the worker's first heartbeat comes after its warm-up and its budget's fit
            import redis

            from tokq.queue.keys import QueueKeys
            from tokq.up import up_worker_id

            client = redis.Redis.from_url(redis_server.url)
            key = QueueKeys(queue).heartbeat(up_worker_id(0, shared=True))  # tokq up on this Redis's URL
            try:
                harness.wait_until(lambda: client.exists(key), "a tokq worker heartbeat", [proc], poll_s=0.1)
                status = json.loads(client.get(key))
            finally:
                client.close()
            system.token_budget, system.budget_source = int(status["token_budget"]), status.get("budget_source", "")
    except BaseException:
        system.close()
        raise
    return system
