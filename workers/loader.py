"""Weights from a local Hugging Face directory: ``model.safetensors`` or the shards listed in
``model.safetensors.index.json``. Names lose the prefix their head class added (``bert.``,
``model.``); tensors outside the base model (lm_head, MLM heads, pooler) are never read."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# TF-era BERT checkpoints name LayerNorm parameters gamma/beta
_LEGACY_SUFFIXES = {".gamma": ".weight", ".beta": ".bias"}


def weight_files(path: Path) -> dict[str, Path]:
    """Every tensor name in the checkpoint -> the file holding it."""
    if (path / INDEX_FILE).is_file():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    if (path / SINGLE_FILE).is_file():
        with safe_open(str(path / SINGLE_FILE), framework="pt") as f:
            return {name: path / SINGLE_FILE for name in f.keys()}
    raise FileNotFoundError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE} "
                            "(only safetensors checkpoints are supported)")


def _canonical(name: str) -> str:
    for old, new in _LEGACY_SUFFIXES.items():
        if name.endswith(old):
            return name[: -len(old)] + new
    return name


def load_weights(path: Path, anchor: str, *, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The base model's tensors on the host, named relative to it, floats cast to ``dtype``.
    They stay on the host so the model fuses its projections (qkv, gate-up) there and moves
    each result once: concatenating on the GPU would hold the parts and the whole at once.

    ``anchor`` is a name every checkpoint of the family has (e.g. ``embed_tokens.weight``);
    whatever precedes it in the file is the prefix to strip.
    """
    files = weight_files(path)
    canonical = {_canonical(name): name for name in files}
    matches = sorted((n for n in canonical if n == anchor or n.endswith("." + anchor)), key=len)
    if not matches:
        raise KeyError(f"{path}: no tensor named like {anchor!r}; is this the right architecture?")
    prefix = matches[0][: -len(anchor)]
    wanted = {name[len(prefix):]: stored for name, stored in canonical.items() if name.startswith(prefix)}
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for name, stored in wanted.items():
        by_file.setdefault(files[stored], []).append((name, stored))
    weights: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name, stored in names:
                tensor = f.get_tensor(stored)
                weights[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return weights


def moved(layer, device: torch.device):
    """A copy of the frozen dataclass ``layer`` with every tensor field on ``device``."""
    return dataclasses.replace(layer, **{
        f.name: getattr(layer, f.name).to(device) for f in dataclasses.fields(layer)
        if isinstance(getattr(layer, f.name), torch.Tensor)})


def packed(layer, pack):
    """A copy of the frozen dataclass ``layer`` with every linear weight (each 2-d tensor field)
    passed through ``pack``: the layout its linear kernel reads fastest."""
    return dataclasses.replace(layer, **{
        f.name: pack(getattr(layer, f.name)) for f in dataclasses.fields(layer)
        if isinstance(getattr(layer, f.name), torch.Tensor) and getattr(layer, f.name).dim() == 2})


def take(weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """``weights[name]``, with an error that says which tensor a checkpoint lacks."""
    try:
        return weights[name]
    except KeyError:
        raise KeyError(f"checkpoint lacks tensor {name!r}") from None
