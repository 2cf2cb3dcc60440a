"""Where the prompt ends in each tokenized input, so a decoder worker computes a shared
instruction once (issue 15) and the queue counts only the tokens it will compute.

Only decoder models with causal attention and last-token pooling use it: there a prompt's
tokens never see what follows them, so their K/V are the same for every input behind that
prompt. An encoder's attention is bidirectional: every prompt token attends to the query, so
nothing of it can be shared.

The boundary is checked per input, on the full string's own tokens: the input's prefix is the
longest run of leading tokens it shares with the prompt tokenized alone (special tokens
included). A prompt ending at a clean token boundary (Qwen3-Embedding's ``...\\nQuery:``) shares
all of its tokens; one ending mid-word or in a space that merges into the next word (``Query: ``
+ ``hello`` -> ``Query``, ``:``, `` hello``) shares all but its last piece; an input sharing
nothing takes the full path. The worker caches K/V by the prefix's exact ids, so whatever the
split, the result is the full forward's.
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

    def prefix_lens(self, prompt: str, seqs: Sequence[Sequence[int]]) -> list[int]:
        """Per input: how many leading tokens are the shared prompt (0: the full path)."""
        prompt_ids = self._prompt_ids.get(prompt) if prompt else None
        if not prompt_ids:
            return [0] * len(seqs)
        return [shared_prefix_len(seq, prompt_ids) for seq in seqs]


def shared_prefix_len(seq: Sequence[int], prompt_ids: Sequence[int]) -> int:
    """Leading tokens ``seq`` has in common with ``prompt_ids``, leaving at least one of its own."""
    limit = min(len(seq) - 1, len(prompt_ids))
    if list(seq[:limit]) == list(prompt_ids[:limit]):
        return max(limit, 0)
    n = 0
    while seq[n] == prompt_ids[n]:
        n += 1
    return n
