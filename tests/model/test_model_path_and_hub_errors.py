"""--model, however it is spelled or whatever is wrong with it: one folder gets one served name
(and so one queue) from every spelling of its path; a repo or revision the hub lacks, a hub that
cannot be reached, and weights that do not fit their config or cannot be read are each one
`Error: ...` line from the worker, the gateway and `tokq up`, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_models_by_hub_id import COMMIT, REPO, LoopbackHub, build_hub_cache
from tiny_models import build
from tokq.model.fingerprint import model_fingerprint
from tokq.model.info import ModelInfo, bundled_model_path
from tokq.model.source import resolve

NO_REDIS = ["--redis-url", "redis://127.0.0.1:1/0"]  # never reached: the model fails first


def link_model(dst: Path) -> Path:
    """The bundled model at ``dst``, its files as symlinks (no 90 MB copy)."""
    src = bundled_model_path()
    for file in src.rglob("*"):
        if file.is_file():
            (dst / file.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            (dst / file.relative_to(src)).symlink_to(file)
    return dst


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # the fingerprint's hash cache
    (tmp_path / "bge" / "other").mkdir(parents=True)
    return link_model(tmp_path / "bge" / "model")


@pytest.mark.parametrize("cwd,spelling", [
    ("bge/model", "."), ("bge", "model"), ("bge", "model/"), ("bge", "./model"), ("bge/other", "../model"),
    ("bge/model", "../model"), ("bge/model", "../../bge/model"), ("/", None), ("bge", "alias"),
])
def test_every_spelling_of_one_folder_gets_one_name_and_queue(model_dir, monkeypatch, cwd, spelling):
    # '.' was named '' (queue "default@..."), '../model' '..': a gateway and a worker given
    # different spellings of one folder used different queues, silently.
    root = model_dir.parent.parent
    (root / "bge" / "alias").symlink_to(model_dir)
    monkeypatch.chdir(root / cwd if cwd != "/" else "/")
    spelling = spelling or str(model_dir)  # the absolute path
    assert resolve(spelling).name == "bge"
    assert resolve(spelling).path == model_dir.resolve()
    info = ModelInfo.load(spelling)
    monkeypatch.chdir("/")
    assert info.queue_name == ModelInfo.load(model_dir).queue_name
    assert info.queue_name.startswith("bge@")


def test_the_fingerprint_does_not_depend_on_the_spelling(model_dir, monkeypatch):
    want = model_fingerprint(model_dir)
    monkeypatch.chdir(model_dir)
    assert model_fingerprint(Path(".")) == want
    assert model_fingerprint(Path("../model")) == want
    monkeypatch.chdir(model_dir.parent / "other")
    assert model_fingerprint(Path("../model/")) == want


@pytest.mark.parametrize("cwd,spelling", [("models--acme--mini-lm", f"snapshots/{COMMIT}"),
                                          (f"models--acme--mini-lm/snapshots/{COMMIT}", "."),
                                          ("models--acme--mini-lm/snapshots", f"../snapshots/{COMMIT}")])
def test_a_relative_snapshot_path_is_named_by_repo_id_not_commit_hash(tmp_path, monkeypatch, cwd, spelling):
    cache = tmp_path / "hub"
    build_hub_cache(cache)
    monkeypatch.chdir(cache / cwd)
    assert resolve(spelling).name == REPO


class StatusHub(LoopbackHub):
    """A hub on loopback that answers every request with one status and X-Error-Code, as the
    Hugging Face Hub answers a repo or revision it does not have, or a gated one."""

    def __init__(self, status: int, error_code: str | None) -> None:
        self.status, self.error_code = status, error_code
        super().__init__()

    def answer(self, path: str) -> tuple[int, bytes, dict[str, str]]:
        headers = {"X-Error-Code": self.error_code} if self.error_code else {}
        headers |= {"X-Error-Message": "nope", "Content-Type": "application/json"}
        return self.status, json.dumps({"error": "nope"}).encode(), headers

    @property
    def paths(self) -> list[str]:
        return [path for _, path in self.requests]


def closed_port() -> int:
    import socket

    with socket.socket() as sock:  # bound, never listening: connections to it are refused
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def hub_env(tmp_path: Path, endpoint: str) -> dict[str, str]:
    """Downloads allowed, from ``endpoint`` only, into a cache of this test's own. Any other host
    goes through a proxy that refuses, so nothing can reach the real Hub."""
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HUB_CACHE": str(tmp_path / "hub"),
           "HF_HOME": str(tmp_path / "hf-home"), "XDG_CACHE_HOME": str(tmp_path / "xdg"),
           "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONWARNINGS": "ignore",
           "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        env[name] = "http://127.0.0.1:1"
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        env.pop(name, None)
    return env


def one_error_line(args: list[str], env: dict[str, str], cwd: Path | None = None) -> str:
    run = subprocess.run([sys.executable, "-m", "tokq.cli", *args], capture_output=True, text=True,
                         env=env, cwd=cwd, timeout=180)
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), run.stderr
    return lines[0]


MISSING = "acme/no-such-model"
HUB_CASES = {  # name -> (status, X-Error-Code, --revision, what the line says)
    "repo": (404, "RepoNotFound", None, f"{MISSING} is not a model repo on {{url}} (HTTP 404)"),
    "revision": (404, "RevisionNotFound", "v9", f"{MISSING} has no revision 'v9' on {{url}} (HTTP 404)"),
    "gated": (403, "GatedRepo", None, f"{MISSING} is gated on {{url}} (HTTP 403)"),
    "server_error": (500, None, "v2", f"cannot download {MISSING} at revision v2 from {{url}} ("),
}
COMMANDS_AND_CASES = [*(pytest.param("worker", case, marks=pytest.mark.slow) for case in sorted(HUB_CASES)),
                      *((command, case) for command in ("gateway", "up") for case in ("repo", "revision"))]


# The snapshot is fetched in one place for every command: each case through the worker, the
# commonest two through the gateway and `tokq up` too.
@pytest.mark.parametrize("command,case", COMMANDS_AND_CASES)
def test_a_repo_or_revision_the_hub_lacks_is_one_error_line(tmp_path, command, case):
    # These were a ~28-line traceback (RepositoryNotFoundError and its kin are OSErrors, which
    # the commands did not catch).
    status, code, revision, needle = HUB_CASES[case]
    hub = StatusHub(status, code)
    try:
        args = [command, "--model", MISSING, *(["--revision", revision] if revision else []),
                *NO_REDIS]
        line = one_error_line(args, hub_env(tmp_path, hub.url))
        assert hub.paths, "the fake hub was never asked"
    finally:
        hub.close()
    assert line.startswith("Error: " + needle.format(url=hub.url)), line


@pytest.mark.parametrize("command", [pytest.param("worker", marks=pytest.mark.slow), "up"])
def test_an_unreachable_hub_names_the_repo_and_the_endpoint(tmp_path, command):
    url = f"http://127.0.0.1:{closed_port()}"
    line = one_error_line([command, "--model", MISSING, *NO_REDIS], hub_env(tmp_path, url))
    assert line.startswith(f"Error: cannot download {MISSING} from {url} ("), line
    assert "Connection refused" in line and str(tmp_path / "hub") in line, line


def test_hub_errors_in_process_are_one_line_file_not_found_errors(tmp_path, monkeypatch):
    # As the commands see them (model_errors_as_one_line catches FileNotFoundError).
    for name, value in hub_env(tmp_path, "unused").items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    hub = StatusHub(404, "RevisionNotFound")
    monkeypatch.setenv("HF_ENDPOINT", hub.url)  # read at call time, not at huggingface_hub's import
    try:
        with pytest.raises(FileNotFoundError) as caught:
            resolve(MISSING, revision="v9")
    finally:
        hub.close()
    assert "\n" not in str(caught.value) and hub.url in str(caught.value)


def broken_copy(tmp_path: Path, case: str) -> Path:
    """A tiny BERT whose weights do not fit its config, or cannot be read."""
    path = tmp_path / case
    build("bert", path)
    config = json.loads((path / "config.json").read_text())
    weights = path / "model.safetensors"
    if case == "more_layers_than_weights":
        config["num_hidden_layers"] += 1
    elif case == "qwen_config_over_bert_weights":
        config = {"architectures": ["Qwen3Model"], "model_type": "qwen3", "vocab_size": 211,
                  "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "intermediate_size": 96, "head_dim": 16,
                  "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
    elif case == "truncated_weights":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif case == "index_without_weight_map":
        weights.unlink()
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    elif case == "index_lists_a_missing_shard":
        weights.rename(path / "model-00001-of-00002.safetensors")
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "embeddings.word_embeddings.weight": "model-00001-of-00002.safetensors",
            "encoder.layer.1.output.dense.weight": "model-00002-of-00002.safetensors"}}))
    (path / "config.json").write_text(json.dumps(config))
    return path


BROKEN = {  # case -> what the line says after "Error: <model dir>/"
    "more_layers_than_weights": "model.safetensors lacks tensor 'encoder.layer.2.",
    "qwen_config_over_bert_weights": "model.safetensors has no tensor named like 'embed_tokens.weight'",
    "truncated_weights": "model.safetensors is not a readable safetensors file (",
    "index_without_weight_map": "model.safetensors.index.json is not a safetensors index",
    "index_lists_a_missing_shard": "model-00002-of-00002.safetensors is missing",
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_weights_are_one_error_line_from_the_worker(tmp_path, case):
    # These were tracebacks (KeyError, SafetensorError) and, under `tokq up`, a worker that
    # crashed and restarted.
    path = broken_copy(tmp_path, case)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    line = one_error_line(["worker", "--model", str(path), "--burst", "--device", "cpu", *NO_REDIS], env)
    assert line.startswith(f"Error: {path}/{BROKEN[case]}"), line


def test_a_layer_count_mismatch_says_so_and_an_intact_copy_loads(tmp_path):
    from tokq.workers.engine import Engine

    with pytest.raises(ValueError, match=r"asks for layer 2, the weights hold 2 layers"):
        Engine.load(str(broken_copy(tmp_path, "more_layers_than_weights")), device="cpu", dtype="float32")
    intact = tmp_path / "intact"
    build("bert", intact)
    assert Engine.load(str(intact), device="cpu", dtype="float32").info.name == "intact"
