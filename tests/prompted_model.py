"""A tiny random Qwen3 with a real byte-level BPE tokenizer that appends <|endoftext|> (as
Qwen3-Embedding's does) and Qwen3-Embedding's prompts, saved as a model directory (no tests
here; shared by the shared-prompt tests)."""

from __future__ import annotations

import json

import torch
import transformers
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

INSTRUCT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
PROMPTS = {
    "query": INSTRUCT,  # Qwen3-Embedding's form: ends at a clean token boundary
    "spaced": INSTRUCT + " ",  # the space merges into the query's first word
    "midword": "Instruct: summ",  # the last word continues in the input
    "document": "",
}
TEXTS = ["what is the capital of france", "arize the search results", "x",
         "how do transformers pool embeddings for retrieval", "query", "passages"]
CORPUS = [INSTRUCT, "summarize the passages that answer a web search query"] + TEXTS * 3


def build_prompted_qwen3(path, default_prompt_name: str | None = None) -> None:
    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    rust.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    eos = rust.token_to_id("<|endoftext|>")
    rust.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>",
                                                        special_tokens=[("<|endoftext|>", eos)])
    transformers.PreTrainedTokenizerFast(tokenizer_object=rust, eos_token="<|endoftext|>").save_pretrained(path)
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=rust.get_vocab_size(), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=96, max_position_embeddings=256,
        architectures=["Qwen3Model"])
    model = transformers.Qwen3Model(config)
    with torch.no_grad():  # weights far from init: sharp attention, positions matter
        gen = torch.Generator().manual_seed(1)
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.2 * noise if "norm" in name else 0.15 * noise)
    model.save_pretrained(path)
    st_config = {"prompts": PROMPTS}
    if default_prompt_name:
        st_config["default_prompt_name"] = default_prompt_name
    (path / "config_sentence_transformers.json").write_text(json.dumps(st_config))
