"""Weights from a local Hugging Face directory: ``model.safetensors`` or the shards listed in
``model.safetensors.index.json``. Names lose the prefix their head class added (``bert.``,
``model.``); tensors outside the base model (lm_head, MLM heads) are read only by name, for a
reranker's head (``load_tensors``), and then only the rows it uses."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# TF-era BERT checkpoints name LayerNorm parameters gamma/beta
_LEGACY_SUFFIXES = {".gamma": ".weight", ".beta": ".bias"}
_LAYER = re.compile(r"(?:^|\.)layers?\.(\d+)\.")  # BERT: encoder.layer.N., Qwen: layers.N.


class BrokenCheckpoint(ValueError):
    """Weights that do not fit their config or cannot be read: a ValueError naming the file, so
    the commands that load a model say it in one line (tokq.model.source.model_errors_as_one_line)."""


class Weights(dict):
    """Tensor name -> tensor, knowing where it was read from, so ``take`` can say which file
    lacks a tensor the config asks for."""

    source: str = "checkpoint"
    prefix: str = ""


def _checkpoint_name(path: Path) -> str:
    return str(path / (INDEX_FILE if (path / INDEX_FILE).is_file() else SINGLE_FILE))


def _open(file: Path, **kwargs):
    try:
        return safe_open(str(file), framework="pt", **kwargs)
    except SafetensorError as exc:  # truncated, or not a safetensors file at all
        raise BrokenCheckpoint(f"{file} is not a readable safetensors file ({exc}): "
                               "a partial download? fetch it again") from None
    except FileNotFoundError:  # a shard the index lists
        raise BrokenCheckpoint(f"{file} is missing (listed in {file.parent / INDEX_FILE})") from None


def weight_files(path: Path) -> dict[str, Path]:
    """Every tensor name in the checkpoint -> the file holding it."""
    if (path / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
            return {str(name): path / str(file) for name, file in weight_map.items()}
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise BrokenCheckpoint(f"{path / INDEX_FILE} is not a safetensors index (a JSON object whose "
                                   f"'weight_map' maps tensor names to files): {exc!r}") from None
    if (path / SINGLE_FILE).is_file():
        with _open(path / SINGLE_FILE) as f:
            return {name: path / SINGLE_FILE for name in f.keys()}
    raise FileNotFoundError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE} "
                            "(only safetensors checkpoints are supported)")


def _canonical(name: str) -> str:
    for old, new in _LEGACY_SUFFIXES.items():
        if name.endswith(old):
            return name[: -len(old)] + new
    return name


def load_weights(path: Path, anchor: str, *, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The base model's tensors on the host (so projections are fused there, not holding parts and
    whole on the GPU), named relative to it, floats cast to ``dtype``. ``anchor``: a name every
    checkpoint of the family has; whatever precedes it in the file is stripped."""
    files = weight_files(path)
    canonical = {_canonical(name): name for name in files}
    matches = sorted((n for n in canonical if n == anchor or n.endswith("." + anchor)), key=len)
    if not matches:
        raise BrokenCheckpoint(f"{_checkpoint_name(path)} has no tensor named like {anchor!r}, which the "
                               f"architecture in {path / 'config.json'} needs: do config.json and the "
                               "weights belong to one model?")
    prefix = matches[0][: -len(anchor)]
    wanted = {name[len(prefix):]: stored for name, stored in canonical.items() if name.startswith(prefix)}
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for name, stored in wanted.items():
        by_file.setdefault(files[stored], []).append((name, stored))
    weights = Weights()
    weights.source, weights.prefix = _checkpoint_name(path), prefix
    for file, names in by_file.items():
        with _open(file, device="cpu") as f:
            for name, stored in names:
                try:
                    tensor = f.get_tensor(stored)
                except SafetensorError as exc:  # the header parsed but a tensor cannot be read
                    raise BrokenCheckpoint(f"{file}: cannot read tensor {stored!r} ({exc})") from None
                weights[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return weights


def load_tensors(path: Path, names: list[str], *, dtype: torch.dtype,
                 rows: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Tensors by their full checkpoint names (a head outside the base model: a classifier, the
    LM head), floats cast to ``dtype``; with ``rows``, only those rows of each are read from disk.
    A name absent from the checkpoint is absent from the result."""
    files = weight_files(path)
    out = {}
    for name in names:
        if name not in files:
            continue
        with _open(files[name], device="cpu") as f:
            try:
                if rows is None:
                    tensor = f.get_tensor(name)
                else:
                    part = f.get_slice(name)
                    tensor = torch.stack([part[r:r + 1][0] for r in rows])
            except SafetensorError as exc:
                raise BrokenCheckpoint(f"{files[name]}: cannot read tensor {name!r} ({exc})") from None
        out[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return out


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
    """``weights[name]``, with an error that says which file lacks which tensor."""
    try:
        return weights[name]
    except KeyError:
        pass
    source, prefix = getattr(weights, "source", "checkpoint"), getattr(weights, "prefix", "")
    hint = ""
    if match := _LAYER.search(name):  # the commonest mismatch: config.json asks for more layers
        kind = name[:match.end(1)].removesuffix(match.group(1))
        layers = {m.group(1) for n in weights if (m := _LAYER.search(n)) and n.startswith(kind)}
        if match.group(1) not in layers:  # not a tensor missing from a layer the weights have
            hint = (f"; config.json asks for layer {match.group(1)}, the weights hold {len(layers)} "
                    "layers: does its layer count (num_hidden_layers) match them?")
    raise BrokenCheckpoint(f"{source} lacks tensor {prefix + name!r}{hint}")
