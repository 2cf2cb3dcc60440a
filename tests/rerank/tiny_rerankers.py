"""Tiny random-weight rerankers saved as model folders (no tests here): a BERT cross-encoder on the
bundled all-MiniLM-L6-v2 tokenizer (plain transformers folder, as cross-encoder/ms-marco-* are
published, or saved by sentence-transformers), a Qwen3 causal LM reranker built and saved by
sentence-transformers 6 (LogitScore over "yes"/"no"), and a Qwen3 sequence classifier with the same
chat template (the seq-cls conversions of Qwen3-Reranker)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from tiny_models import randomize
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from tokq.model.info import bundled_model_path
from tokq.testing.rerankers import QWEN3_RERANKER_TEMPLATE


QUERY = "what is the capital of france"
DOCUMENTS = [
    "paris is the capital of france",
    "yes",
    "the search results answer the query about the capital",
    "no no no",
    "a document about rivers and bridges and the towns along them",
    "x",
]
LONG_DOCUMENT = " ".join(["the capital of france is paris and the query is answered"] * 40)


def _qwen3_tokenizer(path: Path, max_length: int) -> transformers.PreTrainedTokenizerFast:
    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    corpus = [QWEN3_RERANKER_TEMPLATE, "yes no", "yes", "no", QUERY, *DOCUMENTS] * 5
    rust.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=rust, eos_token="<|im_end|>",
                                               pad_token="<|endoftext|>", model_max_length=max_length)
    tok.chat_template = QWEN3_RERANKER_TEMPLATE
    tok.save_pretrained(path)
    return tok


def _qwen3_config(vocab: int, **extra) -> transformers.Qwen3Config:
    return transformers.Qwen3Config(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, intermediate_size=96,
                                    max_position_embeddings=512, **extra)


def build_qwen3_causal_reranker(path: Path, *, max_length: int = 160, tied: bool = False) -> Path:
    """A Qwen3ForCausalLM folder as sentence-transformers 6 saves a CrossEncoder over it
    (modules.json: Transformer, LogitScore with the "yes"/"no" ids); returns the saved folder."""
    from sentence_transformers import CrossEncoder

    plain = path / "plain"
    plain.mkdir(parents=True)
    tok = _qwen3_tokenizer(plain, max_length)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(_qwen3_config(len(tok), tie_word_embeddings=tied))
    randomize(model)
    model.save_pretrained(plain)
    saved = path / "saved"
    CrossEncoder(str(plain), device="cpu").save(str(saved))
    return saved


def build_qwen3_seq_cls(path: Path, *, max_length: int = 160) -> Path:
    """A Qwen3ForSequenceClassification (one label) folder with Qwen3-Reranker's chat template."""
    path.mkdir(parents=True)
    tok = _qwen3_tokenizer(path, max_length)
    torch.manual_seed(0)
    model = transformers.Qwen3ForSequenceClassification(
        _qwen3_config(len(tok), num_labels=1, pad_token_id=tok.pad_token_id))
    randomize(model)
    model.save_pretrained(path)
    return path


def build_bert_cross_encoder(path: Path, *, activation: str | None = None, num_labels: int = 1,
                             max_length: int = 128) -> Path:
    """A BertForSequenceClassification folder as cross-encoder/ms-marco-* are published (config,
    weights, tokenizer; no sentence-transformers files); ``activation``: config.json's
    sbert_ce_default_activation_function."""
    path.mkdir(parents=True)
    tok = transformers.AutoTokenizer.from_pretrained(str(bundled_model_path()))
    tok.model_max_length = max_length
    tok.save_pretrained(path)
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64,
                                     max_position_embeddings=max_length, num_labels=num_labels)
    model = transformers.BertForSequenceClassification(config)
    randomize(model)
    model.save_pretrained(path)
    if activation:
        cfg = json.loads((path / "config.json").read_text())
        cfg["sbert_ce_default_activation_function"] = activation
        (path / "config.json").write_text(json.dumps(cfg))
    return path


def save_with_sentence_transformers(folder: Path, out: Path) -> Path:
    """``folder`` loaded as a CrossEncoder and saved again (modules.json, model_type CrossEncoder)."""
    from sentence_transformers import CrossEncoder

    CrossEncoder(str(folder), device="cpu").save(str(out))
    return out
