"""What the gateway and the workers know about a model without loading its weights.

Read from a local Hugging Face / sentence-transformers directory (tokq/model/source.py finds it,
from a path or a Hugging Face repo id): the task (embed or rerank, decided as sentence-transformers
decides it), the architecture, hidden size, max input length, pooling, normalization, prompts and,
for a reranker, how a pair becomes one score.
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

ENCODER_ARCHS = {"BertModel": "bert", "BertForMaskedLM": "bert", "BertForSequenceClassification": "bert"}
DECODER_ARCHS = {"Qwen2Model": "qwen2", "Qwen2ForCausalLM": "qwen2", "Qwen2ForSequenceClassification": "qwen2",
                 "Qwen3Model": "qwen3", "Qwen3ForCausalLM": "qwen3", "Qwen3ForSequenceClassification": "qwen3"}
TASKS = ("embed", "rerank")
# sentence-transformers' model_type (config_sentence_transformers.json) -> tokq's task
ST_MODEL_TYPES = {"SentenceTransformer": "embed", "CrossEncoder": "rerank"}
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
# A CrossEncoder's modules: the transformer (a classifier head, or a causal LM) and LogitScore.
ST_RERANK_MODULES = ("Transformer", "LogitScore")
# CrossEncoder's activation_fn (a dotted torch path, trusted only under torch.) -> tokq's name
ST_ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": "identity", "Tanh": "tanh"}
# Files a tokenizer is built from; without any, transformers builds an empty one (every text
# then tokenizes to [UNK]s and embeds alike). vocab.json takes merges.txt with it (BPE).
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model")


class UnsupportedModel(ValueError):
    pass


__all__ = ["ModelInfo", "Scoring", "UnsupportedModel", "bundled_model_path"]


def _read_json(path: Path) -> dict | list | None:
    return json.loads(path.read_text()) if path.is_file() else None


@dataclass(frozen=True)
class Scoring:
    """How a reranker turns one (query, document) pair into one score, as CrossEncoder does."""

    # classifier: BERT's pooler and classifier on [CLS]; score: a sequence classifier's score row
    # on the last token; lm_rows: LogitScore, the LM head's true (minus false) row on the last token
    head: str
    activation: str  # sigmoid | identity | tanh, applied unless raw scores are asked for
    true_token_id: int | None = None  # lm_rows only
    false_token_id: int | None = None  # lm_rows, optional
    # text: the tokenizer's own pair template (segment ids included); chat: the chat template
    # rendering a "query" and a "document" message
    pair_format: str = "text"
    message_format: str = "flat"  # chat: message content as a string (flat) or typed parts

    def activate(self, raw: np.ndarray) -> np.ndarray:
        """float32 scores after the activation CrossEncoder applies to ``raw`` (float32 logits)."""
        raw = np.asarray(raw, dtype=np.float32)
        if self.activation == "sigmoid":  # split by sign: no overflow in exp for large |x|
            e = np.exp(-np.abs(raw))
            return np.where(raw >= 0, 1 / (1 + e), e / (1 + e)).astype(np.float32)
        if self.activation == "tanh":
            return np.tanh(raw).astype(np.float32)
        return raw


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
    task: str = "embed"  # embed | rerank
    scoring: Scoring | None = None  # rerank only

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

    @property
    def is_reranker(self) -> bool:
        return self.task == "rerank"

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
        task = _task(path, cfg, st_prompts)
        prompts = {k: v for k, v in (st_prompts.get("prompts") or {}).items() if isinstance(v, str)}
        default_prompt_name = st_prompts.get("default_prompt_name")
        if default_prompt_name is not None and default_prompt_name not in prompts:
            # as sentence-transformers refuses it: else every call without prompt_name fails
            raise UnsupportedModel(
                f"default_prompt_name {default_prompt_name!r} in config_sentence_transformers.json is "
                f"not among its prompts ({', '.join(sorted(prompts)) or 'none'})")
        scoring = None
        if task == "rerank":
            scoring = _scoring(path, cfg, st_cfg, st_prompts)
            pooling, normalize, include_prompt = ("cls" if scoring.head == "classifier" else "last"), False, True
        else:
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
            task=task,
            scoring=scoring,
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


def _architecture(cfg: dict) -> str:
    """The first architecture tokq knows, else ''."""
    return next((a for a in cfg.get("architectures") or [] if a in ENCODER_ARCHS or a in DECODER_ARCHS), "")


def _task(path: Path, cfg: dict, st_config: dict) -> str:
    """embed or rerank, as sentence-transformers decides: a folder it saved (modules.json) says so in
    config_sentence_transformers.json's model_type (none: SentenceTransformer); a plain transformers
    folder reranks when it is a sequence classifier (what CrossEncoder loads), else embeds."""
    if (path / "modules.json").is_file():
        kind = st_config.get("model_type", "SentenceTransformer")
        if kind not in ST_MODEL_TYPES:
            raise UnsupportedModel(f"unsupported sentence-transformers model_type {kind!r} in "
                                   f"{path / 'config_sentence_transformers.json'}; supported: "
                                   + ", ".join(f"{k} ({t})" for k, t in ST_MODEL_TYPES.items()))
        return ST_MODEL_TYPES[kind]
    return "rerank" if _architecture(cfg).endswith("ForSequenceClassification") else "embed"


def _scoring(path: Path, cfg: dict, st_cfg: dict, st_config: dict) -> Scoring:
    """How CrossEncoder scores this folder: its head, its activation and how it renders a pair."""
    arch = _architecture(cfg)
    logit_score = None
    modules = _read_json(path / "modules.json")
    if modules is not None:
        if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
            raise UnsupportedModel(f"{path / 'modules.json'} is not a list of sentence-transformers modules")
        for mod in modules:
            kind = str(mod.get("type", ""))
            name = kind.rsplit(".", 1)[-1]
            if not kind.startswith("sentence_transformers.") or name not in ST_RERANK_MODULES:
                raise UnsupportedModel(f"unsupported sentence-transformers module {kind!r} in a CrossEncoder's "
                                       f"modules.json; supported: {', '.join(ST_RERANK_MODULES)}")
            if name == "LogitScore":
                where = path / mod.get("path", "") / "config.json"
                logit_score = _read_json(where)
                if not isinstance(logit_score, dict):
                    raise FileNotFoundError(f"{where} is missing: modules.json names a LogitScore module there")
    if arch.endswith("ForCausalLM"):
        if logit_score is None:
            raise UnsupportedModel(f"{path} is a CrossEncoder over a causal LM ({arch}) without a LogitScore "
                                   "module: nothing says which tokens score a pair")
        if logit_score.get("module_input_name", "causal_logits") != "causal_logits":
            raise UnsupportedModel(f"unsupported LogitScore module_input_name "
                                   f"{logit_score['module_input_name']!r}; supported: causal_logits")
        true_id, false_id = logit_score.get("true_token_id"), logit_score.get("false_token_id")
        vocab = int(cfg.get("vocab_size", 0))
        for label, tid in (("true_token_id", true_id), ("false_token_id", false_id)):
            if (tid is not None or label == "true_token_id") and (
                    type(tid) is not int or not 0 <= tid < vocab):
                raise UnsupportedModel(f"LogitScore {label} {tid!r} is not a token id of this model (0..{vocab - 1})")
        head, num_labels = "lm_rows", 1
    elif arch.endswith("ForSequenceClassification"):
        if logit_score is not None:
            raise UnsupportedModel(f"a LogitScore module over a sequence classifier ({arch}) is not supported")
        id2label = cfg.get("id2label")
        num_labels = len(id2label) if isinstance(id2label, dict) and id2label else int(cfg.get("num_labels", 2))
        if num_labels != 1:
            raise UnsupportedModel(f"{arch} with {num_labels} labels: a reranker scores one label "
                                   "(CrossEncoder.rank takes num_labels=1 models only)")
        head, true_id, false_id = ("classifier" if arch.startswith("Bert") else "score"), None, None
    else:
        raise UnsupportedModel(f"a CrossEncoder needs a sequence classifier or a causal LM; {path} is "
                               f"{arch or cfg.get('architectures')}")
    # config_sentence_transformers.json is read only for a folder sentence-transformers saved
    activation = _activation(cfg, st_config if modules is not None else None, num_labels)
    return Scoring(head=head, activation=activation, true_token_id=true_id, false_token_id=false_id,
                   **_pair_format(path, cfg, st_cfg))


def _activation(cfg: dict, st_config: dict | None, num_labels: int) -> str:
    """CrossEncoder's activation_fn, taken only under torch. as CrossEncoder trusts it: a saved
    folder's config_sentence_transformers.json (``st_config``), else config.json's
    sentence_transformers.activation_fn or, without one, its older sbert_ce_default_activation_function;
    else (none, or one not trusted) sigmoid for one label."""
    saved = (cfg.get("sentence_transformers") or {})
    legacy = saved["activation_fn"] if "activation_fn" in saved else cfg.get("sbert_ce_default_activation_function")
    for dotted in ((st_config or {}).get("activation_fn"), legacy):
        if isinstance(dotted, str) and dotted.startswith("torch."):
            name = dotted.rsplit(".", 1)[-1]
            if name not in ST_ACTIVATIONS:
                raise UnsupportedModel(f"unsupported CrossEncoder activation_fn {dotted!r}; supported: "
                                       + ", ".join(f"torch.nn.{n}" for n in ST_ACTIVATIONS))
            return ST_ACTIVATIONS[name]
    return "sigmoid" if num_labels == 1 else "identity"


def _chat_template(path: Path) -> str | None:
    """The tokenizer's chat template text, where transformers reads it from; None without one."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    for name in ("chat_template.json", "tokenizer_config.json"):
        template = (_read_json(path / name) or {}).get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template
                             if isinstance(t, dict) and t.get("name") == "default"), None) or ""
        if template:
            return template if isinstance(template, str) else ""
    return None


# model types whose chat templates take message content as a plain string (sentence-transformers' list)
_FLAT_MESSAGE_TYPES = {"apertus", "deepseek_v3", "gpt_oss", "seed_oss"}
_STRUCTURED_PATTERNS = ("content[0]", ".type", "'type'", '"type"', "item.type", "message.content[")


def _pair_format(path: Path, cfg: dict, st_cfg: dict) -> dict:
    """How sentence-transformers' Transformer feeds a pair: through the chat template (query and
    document messages) when its modalities include messages, else as the tokenizer's text pair.
    Saved modalities (sentence_bert_config.json) decide; else a chat template means messages."""
    template = _chat_template(path)
    saved = st_cfg.get("modality_config")
    chat = "message" in saved if isinstance(saved, dict) else template is not None
    if not chat:
        return {"pair_format": "text"}
    fmt = ((saved or {}).get("message") or {}).get("format", "auto")
    if fmt not in ("flat", "structured"):
        if cfg.get("model_type") in _FLAT_MESSAGE_TYPES:
            fmt = "flat"
        elif not template:
            fmt = "structured"
        else:
            fmt = "structured" if any(p in template for p in _STRUCTURED_PATTERNS) else "flat"
    return {"pair_format": "chat", "message_format": fmt}


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
