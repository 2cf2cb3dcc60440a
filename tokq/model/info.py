"""What the gateway and the workers know about a model without loading its weights.

Read from a local Hugging Face / sentence-transformers directory (tokq/model/source.py finds it,
from a path or a Hugging Face repo id): the architecture, hidden size, max input length, pooling,
normalization and query/document prompts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from tokq.model.fingerprint import model_fingerprint
from tokq.queue.keys import queue_name_for
from tokq.model.source import bundled_model_path, resolve

ENCODER_ARCHS = {"BertModel": "bert", "BertForMaskedLM": "bert"}
DECODER_ARCHS = {"Qwen2Model": "qwen2", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3Model": "qwen3", "Qwen3ForCausalLM": "qwen3"}
MODEL_TYPES = {"bert": "bert", "qwen2": "qwen2", "qwen3": "qwen3"}
# sentence-transformers' pooling modes that tokq computes; its others (max, weightedmean,
# mean_sqrt_len_tokens) are refused.
ST_POOLINGS = {"cls": "cls", "mean": "mean", "lasttoken": "last"}
# sentence-transformers' legacy pooling flags, in the order it concatenates their modes.
ST_POOLING_FLAGS = {
    "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken",
}
# The sentence-transformers modules tokq computes: any other (Dense, LayerNorm, ...) changes the
# vector, so a model with one is refused rather than served wrong.
ST_MODULES = ("Transformer", "Pooling", "Normalize")
# Files a tokenizer is built from; without any, transformers builds an empty one (every text
# then tokenizes to [UNK]s and embeds alike). vocab.json takes merges.txt with it (BPE).
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model")


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
    lowercase: bool = False  # sentence_bert_config.json's do_lower_case: lowercase text first

    @cached_property
    def fingerprint(self) -> str:
        """SHA-256 of the files that decide this model's vectors (tokq/model/fingerprint.py)."""
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

    def require_tokenizer(self) -> ModelInfo:
        """This, when the directory has tokenizer files; else FileNotFoundError in one line. Not
        in ``load``: a worker (and `tokq profile`) runs a model without them, from token ids."""
        has = any((self.path / f).is_file() for f in TOKENIZER_FILES) or all(
            (self.path / f).is_file() for f in ("vocab.json", "merges.txt"))
        if not has:
            raise FileNotFoundError(
                f"{self.path} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}, or "
                "vocab.json with merges.txt): tokq cannot tokenize text for this model")
        return self

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
        prompts = {k: v for k, v in (st_prompts.get("prompts") or {}).items() if isinstance(v, str)}
        default_prompt_name = st_prompts.get("default_prompt_name")
        if default_prompt_name is not None and default_prompt_name not in prompts:
            # as sentence-transformers refuses it: else every call without prompt_name fails
            raise UnsupportedModel(
                f"default_prompt_name {default_prompt_name!r} in config_sentence_transformers.json is "
                f"not among its prompts ({', '.join(sorted(prompts)) or 'none'})")
        pooling, normalize, include_prompt = _pooling(path, family)
        if not include_prompt and pooling != "last" and any(prompts.values()):
            # sentence-transformers leaves the prompt's tokens out of the pooled ones; tokq's
            # workers pool every token (the last one, for last-token pooling, is the text's own)
            named = ", ".join(sorted(k for k, v in prompts.items() if v))
            raise UnsupportedModel(f"unsupported pooling: include_prompt=false with {pooling} pooling and "
                                   f"prompts ({named}); tokq pools the prompt's tokens too")
        return cls(
            path=path,
            name=name or source.name,
            family=family,
            hidden_size=int(cfg["hidden_size"]),
            max_length=_max_length(path, cfg, st_cfg),
            pooling=pooling,
            normalize=normalize,
            prompts=prompts,
            default_prompt_name=default_prompt_name,
            config=cfg,
            lowercase=bool(st_cfg.get("do_lower_case")),
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


def _max_length(path: Path, cfg: dict, st_cfg: dict) -> int:
    """Tokens per input as sentence-transformers sets them: the tokenizer arguments' or
    sentence_bert_config.json's max_seq_length, else the tokenizer's model_max_length (where
    sentence-transformers 6 saves it); never past max_position_embeddings, the most the model reads."""
    max_pos = int(cfg.get("max_position_embeddings", 512))
    tok_args = st_cfg.get("tokenizer_args", st_cfg.get("processor_kwargs")) or {}
    length = tok_args.get("model_max_length") or st_cfg.get("max_seq_length")
    if not length:
        length = (_read_json(path / "tokenizer_config.json") or {}).get("model_max_length")
    # none there either: transformers' tokenizer is unbounded, so max_position_embeddings
    return min(int(length), max_pos) if length else max_pos


def _pooling(path: Path, family: str) -> tuple[str, bool, bool]:
    """Pooling, normalization and include_prompt from sentence-transformers' modules, else per family."""
    default = ("last", True, True) if family in ("qwen2", "qwen3") else ("mean", True, True)
    modules = _read_json(path / "modules.json")
    if modules is None:
        return default
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise UnsupportedModel(f"{path / 'modules.json'} is not a list of sentence-transformers modules")
    pooling, normalize, include_prompt = default[0], False, True
    for mod in modules:
        kind = str(mod.get("type", ""))
        name = kind.rsplit(".", 1)[-1]
        if not kind.startswith("sentence_transformers.") or name not in ST_MODULES:
            raise UnsupportedModel(f"unsupported sentence-transformers module {kind!r} in modules.json; "
                                   f"supported: {', '.join(ST_MODULES)}")
        if name == "Pooling":
            where = path / mod.get("path", "") / "config.json"
            pcfg = _read_json(where)
            if not isinstance(pcfg, dict):
                raise FileNotFoundError(f"{where} is missing: modules.json names a Pooling module there")
            pooling = _pooling_mode(pcfg, where)
            include_prompt = pcfg.get("include_prompt", True) is not False
        elif name == "Normalize":
            normalize = True
    return pooling, normalize, include_prompt


def _pooling_mode(pcfg: dict, where: Path) -> str:
    """tokq's pooling for a Pooling config, read as sentence-transformers reads it: pooling_mode
    (6.x: a name or a list), else the legacy pooling_mode_* flags on (none on: mean)."""
    mode = pcfg.get("pooling_mode")
    if mode is None:
        modes = [m for key, m in ST_POOLING_FLAGS.items() if pcfg.get(key)] or ["mean"]
    else:
        modes = [mode] if isinstance(mode, str) else list(mode) if isinstance(mode, list) else [mode]
    supported = ", ".join(ST_POOLINGS)
    if len(modes) != 1:  # sentence-transformers concatenates one vector per mode
        raise UnsupportedModel(f"unsupported pooling {modes} in {where}: one mode only, of {supported}")
    if modes[0] not in ST_POOLINGS:
        raise UnsupportedModel(f"unsupported pooling {modes[0]!r} in {where}; supported: {supported}")
    return ST_POOLINGS[modes[0]]
