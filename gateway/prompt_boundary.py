"""Where the prompt ends in each tokenized input, so a decoder worker computes the shared prompt
once and the queue counts only the tokens it will compute.

Decoders with causal attention and last-token pooling only (docs/internals.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokq.model.info import ModelInfo


class PromptBoundary:
    def __init__(self, info: ModelInfo, tokenizer) -> None:
        """``tokenizer``: gateway.tokenize.Tokenizer. The model's prompts are tokenized once here."""
        self.enabled = info.is_decoder and info.pooling == "last"
        self._prompt_ids: dict[str, list[int]] = {}
        if self.enabled:
            for prompt in set(info.prompts.values()):
                if prompt:
                    self._prompt_ids[prompt] = list(tokenizer.encode_sync([""], prompt=prompt)[0])

    def prompt_lens(self, prompt: str, seqs: Sequence[Sequence[int]]) -> list[int]:
        """Per input: how many leading tokens are the shared prompt (0: the full path)."""
        prompt_ids = self._prompt_ids.get(prompt) if prompt else None
        if not prompt_ids:
            return [0] * len(seqs)
        return [shared_prompt_len(seq, prompt_ids) for seq in seqs]


def shared_prompt_len(seq: Sequence[int], prompt_ids: Sequence[int]) -> int:
    """Leading tokens ``seq`` has in common with ``prompt_ids``, leaving at least one of its own."""
    limit = min(len(seq) - 1, len(prompt_ids))
    if list(seq[:limit]) == list(prompt_ids[:limit]):
        return max(limit, 0)
    n = 0
    while seq[n] == prompt_ids[n]:
        n += 1
    return n
