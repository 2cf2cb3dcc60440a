"""A model's fingerprint: one hash of every file that decides its vectors, carried in the queue
name so two models or versions never share a queue. Weights are hashed in full, each file's hash
cached by path, size, inode, mtime and ctime (docs/internals.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

# What decides a model's vectors besides the weights: config, tokenizer, pooling/normalization.
DEFINING_FILES = (
    "config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "vocab.txt", "vocab.json", "merges.txt", "tokenizer.model",
    "spiece.model", "sentencepiece.bpe.model", "modules.json", "sentence_bert_config.json",
    "config_sentence_transformers.json", "model.safetensors.index.json",
)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_HUB_BLOB = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 8 << 20


def _cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tokq" / "file-sha256.json"


def _load_cache(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _save_cache(path: Path, cache: dict) -> None:
    try:  # best effort: a read-only home only costs a re-hash next time
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".fp-")
        with os.fdopen(fd, "w") as f:
            json.dump(cache, f)
        os.replace(tmp, path)
    except OSError:
        pass


def file_sha256(path: Path, cache: dict | None = None) -> str:
    real = Path(os.path.realpath(path))
    if real.parent.name == "blobs" and _HUB_BLOB.match(real.name):
        return real.name  # the hub stores LFS files under their SHA-256
    st = real.stat()
    key = str(real)
    stamp = [st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]
    if cache is not None and cache.get(key, {}).get("stamp") == stamp:
        return cache[key]["sha256"]
    digest = hashlib.sha256()
    with open(real, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    if cache is not None:
        cache[key] = {"stamp": stamp, "sha256": digest.hexdigest()}
    return digest.hexdigest()


def defining_files(model_dir: Path) -> list[Path]:
    """The files the fingerprint covers: the defining files at the top level, the weights, and
    the config of each sentence-transformers module (e.g. 1_Pooling/config.json)."""
    files = [model_dir / n for n in DEFINING_FILES if (model_dir / n).is_file()]
    files += sorted(p for p in model_dir.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    modules = model_dir / "modules.json"
    if modules.is_file():
        try:
            for mod in json.loads(modules.read_text()):
                sub = str(mod.get("path") or "")
                if sub and (model_dir / sub / "config.json").is_file():
                    files.append(model_dir / sub / "config.json")
        except (ValueError, AttributeError):
            pass  # a malformed modules.json is reported where it is read for pooling
    return files


def model_fingerprint(model_dir: Path) -> str:
    """SHA-256 (hex) over (relative path, SHA-256 of content) of every defining file."""
    model_dir = Path(model_dir)
    cache_file = _cache_path()
    cache = _load_cache(cache_file)
    before = dict(cache)
    outer = hashlib.sha256()
    for path in defining_files(model_dir):
        rel = path.relative_to(model_dir).as_posix()
        outer.update(f"{rel}\0{file_sha256(path, cache)}\n".encode())
    if cache != before:
        _save_cache(cache_file, cache)
    return outer.hexdigest()
