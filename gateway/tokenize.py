"""Tokenization off the event loop: all inputs of a request are batch-encoded at once by the
model's fast (Rust) tokenizer in a small thread pool, so the gRPC loop never blocks on it."""

from __future__ import annotations

import asyncio
import copy
import threading
from concurrent.futures import ThreadPoolExecutor

from transformers import AutoTokenizer

from tokq.gateway.errors import InvalidArgument
from tokq.model_info import ModelInfo


class Tokenizer:
    def __init__(self, info: ModelInfo, num_threads: int = 2) -> None:
        self.info = info
        self._tok = AutoTokenizer.from_pretrained(str(info.path))
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="tokenize")
        # One tokenizer per thread: a fast tokenizer's truncation setting is state on the
        # shared Rust object, so concurrent calls with and without truncate corrupt each other.
        self._local = threading.local()

    def _tokenizer(self):
        tok = getattr(self._local, "tok", None)
        if tok is None:
            tok = self._local.tok = copy.deepcopy(self._tok)
        return tok

    def encode_sync(self, texts: list[str], *, prompt: str = "", truncate: bool = False) -> list[list[int]]:
        max_len = self.info.max_length
        if prompt:
            texts = [prompt + t for t in texts]
        enc = self._tokenizer()(texts, add_special_tokens=True, truncation=truncate,
                        max_length=max_len if truncate else None,
                        return_attention_mask=False, return_token_type_ids=False)
        ids = enc["input_ids"]
        if not truncate:
            for i, seq in enumerate(ids):
                if len(seq) > max_len:
                    raise InvalidArgument(
                        f"input {i} is {len(seq)} tokens long; {self.info.name} takes at most "
                        f"{max_len} tokens per input (special tokens included). Shorten it or set "
                        f"truncate=true to cut it to {max_len}.")
        return ids

    async def encode(self, texts: list[str], *, prompt: str = "", truncate: bool = False) -> list[list[int]]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._pool, lambda: self.encode_sync(texts, prompt=prompt, truncate=truncate))

    def tokens(self, ids: list[int]) -> list[str]:
        return self._tok.convert_ids_to_tokens(ids)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
