"""What the gateway and the workers know about a model without loading its weights.

Read from a local Hugging Face / sentence-transformers directory (tokq/model_source.py finds it,
from a path or a Hugging Face repo id): the architecture, hidden size, max input length, pooling,
normalization and query/document prompts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from tokq.fingerprint import model_fingerprint
from tokq.keys import queue_name_for
from tokq.model_source import bundled_model_path, resolve

ENCODER_ARCHS = {"BertModel": "bert", "BertForMaskedLM": "bert"}
DECODER_ARCHS = {"Qwen2Model": "qwen2", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3Model": "qwen3", "Qwen3ForCausalLM": "qwen3"}
MODEL_TYPES = {"bert": "bert", "qwen2": "qwen2", "qwen3": "qwen3"}
POOLINGS = ("mean", "cls", "last")


class UnsupportedModel(ValueError):
    pass


__all__ = ["ModelInfo", "UnsupportedModel", "bundled_model_path"]


def _read_json(path: Path) -> dict | list | None:
    return json.loads(path.read_text()) if path.is_file() else None


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    name: str
    family: str  # bert | qwen2 | qwen3
    hidden_size: int
    max_length: int  # tokens per input, special tokens included
    pooling: str  # mean | cls | last
    normalize: bool  # the model's own default (sentence-transformers Normalize module)
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    config: dict = field(default_factory=dict, repr=False)

    @cached_property
    def fingerprint(self) -> str:
        """SHA-256 of the files that decide this model's vectors (tokq/fingerprint.py)."""
        return model_fingerprint(self.path)

    @property
    def queue_name(self) -> str:
        """``<name>@<fingerprint prefix>``: another model, or another version of this one,
        served under the same name gets another queue."""
        return queue_name_for(self.name, self.fingerprint)

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding table: every token id must be below it."""
        return int(self.config["vocab_size"])

    @property
    def is_decoder(self) -> bool:
        return self.family in ("qwen2", "qwen3")

    def prompt(self, prompt_name: str | None) -> str:
        """The text prepended to each input; '' when none applies. Unknown names raise KeyError."""
        name = prompt_name if prompt_name is not None else self.default_prompt_name
        if name is None:
            return ""
        if name not in self.prompts:
            raise KeyError(name)
        return self.prompts[name]

    @classmethod
    def load(cls, path: str | Path | None = None, name: str | None = None,
             revision: str | None = None) -> ModelInfo:
        """``path``: a local directory, a Hugging Face repo id or None (the bundled model);
        ``name``: the served name, default the repo id or the directory's name."""
        source = resolve(path, revision)
        path = source.path
        cfg = _read_json(path / "config.json")
        if not isinstance(cfg, dict):
            raise FileNotFoundError(f"{path} has no config.json: not a model directory")
        family = _family(cfg)
        st_cfg = _read_json(path / "sentence_bert_config.json") or {}
        st_prompts = _read_json(path / "config_sentence_transformers.json") or {}
        pooling, normalize = _pooling(path, family)
        max_pos = int(cfg.get("max_position_embeddings", 512))
        max_length = int(st_cfg.get("max_seq_length") or max_pos)
        return cls(
            path=path,
            name=name or source.name,
            family=family,
            hidden_size=int(cfg["hidden_size"]),
            max_length=min(max_length, max_pos),
            pooling=pooling,
            normalize=normalize,
            prompts={k: v for k, v in (st_prompts.get("prompts") or {}).items() if isinstance(v, str)},
            default_prompt_name=st_prompts.get("default_prompt_name"),
            config=cfg,
        )


def first_out_of_vocab(ids, vocab_size: int) -> int | None:
    """The first id outside 0..vocab_size-1, else None. An id past the embedding table would
    index out of bounds in the forward (on CUDA, a device assert that poisons the process)."""
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu":  # a bool or float, or an int past int64 (numpy: float, object)
        return next((t for t in ids if type(t) is not int or not 0 <= t < vocab_size), None)
    mask = (arr < 0) | (arr >= vocab_size)
    return int(arr[np.argmax(mask)]) if mask.any() else None


def _family(cfg: dict) -> str:
    for arch in cfg.get("architectures") or []:
        if arch in ENCODER_ARCHS:
            return ENCODER_ARCHS[arch]
        if arch in DECODER_ARCHS:
            return DECODER_ARCHS[arch]
    if cfg.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[cfg["model_type"]]
    supported = sorted(ENCODER_ARCHS) + sorted(DECODER_ARCHS)
    raise UnsupportedModel(
        f"unsupported model: architectures={cfg.get('architectures')} "
        f"model_type={cfg.get('model_type')!r}; supported: {', '.join(supported)}")


def _pooling(path: Path, family: str) -> tuple[str, bool]:
    """Pooling and normalization from sentence-transformers' modules, else per family."""
    default = ("last", True) if family in ("qwen2", "qwen3") else ("mean", True)
    modules = _read_json(path / "modules.json")
    if not isinstance(modules, list):
        return default
    pooling, normalize = default[0], False
    for mod in modules:
        kind = str(mod.get("type", ""))
        if kind.endswith("Pooling"):
            pcfg = _read_json(path / mod.get("path", "") / "config.json") or {}
            if pcfg.get("pooling_mode_cls_token"):
                pooling = "cls"
            elif pcfg.get("pooling_mode_lasttoken"):
                pooling = "last"
            elif pcfg.get("pooling_mode_mean_tokens"):
                pooling = "mean"
            else:
                modes = [k for k, v in pcfg.items() if k.startswith("pooling_mode") and v]
                raise UnsupportedModel(f"unsupported pooling {modes}; supported: {POOLINGS}")
        elif kind.endswith("Normalize"):
            normalize = True
    return pooling, normalize
