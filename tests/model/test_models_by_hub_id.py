"""Models named by Hugging Face id, resolved through a hub cache built on disk from the bundled
model (models--ORG--NAME/{refs,snapshots,blobs}, as huggingface_hub lays it out), and downloaded
once from a hub on loopback (HF_ENDPOINT) that serves the bundled model's files: no network."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from tokq.queue.keys import QueueKeys
from tokq.model.info import ModelInfo, bundled_model_path
from tokq.model.source import resolve
from service_stack import ctrl_c_reaches_it, read_until_serving

REPO = "acme/mini-lm"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def build_hub_cache(cache: Path, repo_id: str = REPO, commit: str = COMMIT, ref: str = "main") -> Path:
    """huggingface_hub's cache layout: files stored once as blobs (named by content hash),
    snapshot files as relative symlinks to them, refs/<branch> holding the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for src in bundled_model_path().rglob("*"):
        if not src.is_file():
            continue
        data = src.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            shutil.copyfile(src, blob)
        link = snapshot / src.relative_to(bundled_model_path())
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    build_hub_cache(cache)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_repo_id_resolves_to_its_cached_snapshot_and_is_served_under_the_repo_id(hub_cache):
    source = resolve(REPO)
    assert source.path == hub_cache / "models--acme--mini-lm" / "snapshots" / COMMIT
    assert source.name == REPO
    info = ModelInfo.load(REPO)
    assert (info.name, info.hidden_size, info.max_length, info.pooling) == (REPO, 384, 256, "mean")
    assert info.queue_name == "acme_mini-lm@" + info.fingerprint[:8]  # name @ model fingerprint
    assert ModelInfo.load(REPO, revision=COMMIT).path == source.path  # a commit pins it


def test_snapshot_directory_by_path_is_named_by_repo_id_not_commit_hash(hub_cache):
    snapshot = hub_cache / "models--acme--mini-lm" / "snapshots" / COMMIT
    assert ModelInfo.load(snapshot).name == REPO
    assert ModelInfo.load(snapshot, name="minilm").name == "minilm"  # --served-model-name wins


def test_local_directories_still_work_and_take_no_revision(hub_cache):
    assert ModelInfo.load(bundled_model_path()).name == "all-MiniLM-L6-v2"
    assert ModelInfo.load(None).path == bundled_model_path()
    with pytest.raises(ValueError, match="--revision"):
        resolve(bundled_model_path(), revision="main")


def test_offline_and_missing_is_a_clear_error(hub_cache, monkeypatch):
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE=1 forbids downloading"):
        resolve("acme/not-cached")
    monkeypatch.delenv("HF_HUB_OFFLINE")  # huggingface_hub's older name counts the same
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="TRANSFORMERS_OFFLINE=1 forbids downloading"):
        resolve("acme/not-cached")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="at revision v2"):
        resolve(REPO, revision="v2")
    with pytest.raises(FileNotFoundError, match="neither a local directory nor a Hugging Face repo id"):
        resolve("no/such/thing")


@pytest.mark.parametrize("command", ["gateway", "up"])
@pytest.mark.parametrize("model,needle", [
    ("acme/not-cached", "acme/not-cached is not in the Hugging Face cache"),
    ("/no/such/dir", "model '/no/such/dir' is neither a local directory nor a Hugging Face repo id"),
])
def test_a_missing_model_is_one_error_line_for_the_gateway_and_tokq_up(hub_cache, command, model, needle):
    # As for the worker and `tokq profile`: exit status 1 and one line, before Redis is asked
    # (an unreachable one here) or any process starts.
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}  # hub_cache set HF_HUB_CACHE and HF_HUB_OFFLINE=1
    run = subprocess.run([sys.executable, "-m", "tokq.cli", command, "--model", model,
                          "--redis-url", "redis://127.0.0.1:1/0"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"Error: {needle}"), run.stderr


class LoopbackHub:
    """The part of the Hugging Face Hub's HTTP API that huggingface_hub's snapshot_download uses
    (revision info, the file tree, HEAD and GET of each file at a commit), serving the bundled
    model as REPO at COMMIT. Every request is recorded, to count downloads."""

    def __init__(self) -> None:
        root = bundled_model_path()
        self.files = {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                self.do_GET()

            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                hub.requests.append((self.command, path))
                status, body, headers = hub.answer(path)
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command == "GET":
                    self.wfile.write(body)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def answer(self, path: str) -> tuple[int, bytes, dict[str, str]]:
        as_json = {"Content-Type": "application/json"}
        if path.startswith(f"/api/models/{REPO}/revision/"):
            info = {"id": REPO, "sha": COMMIT, "siblings": [{"rfilename": name} for name in self.files]}
            return 200, json.dumps(info).encode(), as_json
        if path == f"/api/models/{REPO}/tree/{COMMIT}":
            tree = [{"type": "file", "path": name, "size": file.stat().st_size,
                     "oid": hashlib.sha1(file.read_bytes()).hexdigest()} for name, file in self.files.items()]
            return 200, json.dumps(tree).encode(), as_json
        name = path.removeprefix(f"/{REPO}/resolve/{COMMIT}/")
        if name in self.files:
            data = self.files[name].read_bytes()
            return 200, data, {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}
        return 404, b'{"error": "not found"}', {**as_json, "X-Error-Code": "RepoNotFound"}

    def downloads(self) -> list[str]:
        prefix = f"/{REPO}/resolve/{COMMIT}/"
        return sorted(path.removeprefix(prefix) for method, path in self.requests
                      if method == "GET" and path.startswith(prefix))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


RESOLVE = """
from tokq.model.info import ModelInfo
info = ModelInfo.load({repo!r})
print(info.path, info.name, info.hidden_size)
"""


def test_a_missing_model_is_downloaded_once_when_downloads_are_allowed(tmp_path):
    hub = LoopbackHub()
    cache = tmp_path / "hub"
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(cache), "HF_HOME": str(tmp_path / "home"),
           "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}  # no proxy for loopback
    for offline in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # huggingface_hub reads these at
        env.pop(offline, None)  # import, so each load is a fresh process

    def load() -> list[str]:
        run = subprocess.run([sys.executable, "-c", RESOLVE.format(repo=REPO)], env=env,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        return run.stdout.split()

    try:
        path, name, hidden = load()
        assert hub.downloads() == sorted(hub.files)  # every file, each once
        snapshot = cache / "models--acme--mini-lm" / "snapshots" / COMMIT
        assert (Path(path), name, hidden) == (snapshot, REPO, "384")  # served under the repo id
        assert all((snapshot / name).read_bytes() == file.read_bytes() for name, file in hub.files.items())
        assert (cache / "models--acme--mini-lm" / "refs" / "main").read_text() == COMMIT

        hub.requests.clear()
        assert load() == [path, name, hidden]
        assert hub.requests == []  # the second start reads the cache and asks the hub nothing
    finally:
        hub.close()


def test_profile_publishes_the_budget_under_the_repo_ids_queue(hub_cache, tmp_path, redis_url):
    from click.testing import CliRunner

    from tokq.profiling.profile.cli import profile_command

    args = ["--model", REPO, "--device", "cpu", "--threads", "1", "--min-tokens", "16", "--max-tokens", "64",
            "--points-per-doubling", "1", "--time-per-point-s", "0.05", "--min-repeats", "3", "--stop-ms", "60000",
            "--quiet", "--slo-p99-ms", "1e9", "--out", str(tmp_path / "p.json"), "--apply",
            "--redis-url", redis_url]
    result = CliRunner().invoke(profile_command, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    import redis

    client = redis.Redis.from_url(redis_url)
    assert int(client.get(QueueKeys(ModelInfo.load(REPO).queue_name).budget)) > 0  # name@fingerprint
    client.close()


@pytest.mark.slow
def test_tokq_up_serves_a_repo_id_from_the_cache_under_its_name(tmp_path, bundled_model_dir):
    import signal
    import subprocess
    import sys
    
    import httpx
    from sentence_transformers import SentenceTransformer

    from tokq import Client
    from tokq.redis.embedded import free_port

    cache = tmp_path / "hub"
    build_hub_cache(cache)
    port, http_port = free_port(), free_port()
    # The name is given once (--model): tokq up's gateway and worker agree on it and on the queue.
    proc = subprocess.Popen([sys.executable, "-m", "tokq.cli", "up", "--model", REPO, "--port", str(port),
                             "--http-port", str(http_port), "--metrics-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
                                 "PYTHONUNBUFFERED": "1"}, preexec_fn=ctrl_c_reaches_it)
    lines = []
    try:
        lines += read_until_serving(proc)
        texts = ["served by its hub id", "from the local cache"]
        with Client(f"127.0.0.1:{port}") as client:
            assert client.info(timeout=10).model == REPO
            got = client.embed(texts, timeout=60)
        want = SentenceTransformer(str(bundled_model_dir), device="cpu").encode(texts, normalize_embeddings=True)
        cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
        assert cos.min() >= 0.9999
        http = f"http://127.0.0.1:{http_port}"
        assert httpx.get(f"{http}/v1/models").json()["data"][0]["id"] == REPO
        resp = httpx.post(f"{http}/v1/embeddings", json={"model": REPO, "input": "hi"}, timeout=60)
        assert resp.status_code == 200 and resp.json()["model"] == REPO
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
