"""A reranker's head: each pair's pooled state -> one raw score, as CrossEncoder computes it before
its activation (the gateway applies that, unless raw scores are asked for). Heads: classifier,
score and lm_rows (docs/internals.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokq.model.info import ModelInfo
from tokq.workers.loader import BrokenCheckpoint, load_tensors, take, weight_files


@dataclass(frozen=True)
class ScoreHead:
    weight: torch.Tensor  # fp32 [k, hidden]: k = 1, or 2 for a true minus a false row
    bias: torch.Tensor | None  # fp32 [k]
    pooler_weight: torch.Tensor | None = None  # fp32 [hidden, hidden]: BERT's pooler, then tanh
    pooler_bias: torch.Tensor | None = None

    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:
        """fp32 ``[N, 1]`` raw scores from fp32 ``[N, hidden]`` pooled states."""
        x = pooled.float()
        if self.pooler_weight is not None:
            x = torch.tanh(torch.nn.functional.linear(x, self.pooler_weight, self.pooler_bias))
        logits = torch.nn.functional.linear(x, self.weight, self.bias)
        if logits.shape[1] == 2:
            logits = logits[:, :1] - logits[:, 1:]
        return logits

    @property
    def num_rows(self) -> int:
        return int(self.weight.shape[0])


def load_head(info: ModelInfo, base: dict[str, torch.Tensor], device: torch.device) -> ScoreHead:
    """The head ``info.scoring`` names, from the checkpoint (``base``: the base model's tensors,
    already read), in fp32 on ``device``."""
    scoring = info.scoring
    if scoring is None:
        raise ValueError(f"{info.name} is not a reranker")
    hidden = info.hidden_size
    pooler_w = pooler_b = bias = None
    if scoring.head == "classifier":
        pooler_w, pooler_b = take(base, "pooler.dense.weight"), take(base, "pooler.dense.bias")
        found = load_tensors(info.path, ["classifier.weight", "classifier.bias"], dtype=torch.float32)
        weight, bias = _required(info, found, "classifier.weight"), found.get("classifier.bias")
    elif scoring.head == "score":
        found = load_tensors(info.path, ["score.weight", "score.bias"], dtype=torch.float32)
        weight, bias = _required(info, found, "score.weight"), found.get("score.bias")
    elif scoring.head == "lm_rows":
        rows = [scoring.true_token_id] + ([scoring.false_token_id] if scoring.false_token_id is not None else [])
        weight = _lm_head_rows(info, base, rows)
    else:
        raise ValueError(f"unknown score head {scoring.head!r}")
    if weight.dim() != 2 or weight.shape[1] != hidden or weight.shape[0] not in (1, 2):
        raise BrokenCheckpoint(f"{info.path}: the score head is {tuple(weight.shape)}, not [1, {hidden}] "
                               "(one label, the model's hidden size)")

    def fp32(t):
        return None if t is None else t.float().to(device)
    return ScoreHead(fp32(weight), fp32(bias), fp32(pooler_w), fp32(pooler_b))


def _required(info: ModelInfo, found: dict, name: str) -> torch.Tensor:
    if name not in found:
        raise BrokenCheckpoint(f"{info.path}: the checkpoint lacks tensor {name!r}, the head of "
                               f"{(info.config.get('architectures') or ['this model'])[0]}")
    return found[name]


def _lm_head_rows(info: ModelInfo, base: dict[str, torch.Tensor], rows: list[int]) -> torch.Tensor:
    """The LM head's ``rows``: its own weight, or the input embeddings' when the two are tied."""
    tied = info.config.get("tie_word_embeddings")
    if tied is not True:
        name = next((n for n in weight_files(info.path) if n == "lm_head.weight" or n.endswith(".lm_head.weight")),
                    None)
        if name is not None:
            return load_tensors(info.path, [name], dtype=torch.float32, rows=rows)[name]
        if tied is False:
            raise BrokenCheckpoint(f"{info.path}: the checkpoint lacks lm_head.weight and config.json says "
                                   "tie_word_embeddings=false")
    return take(base, "embed_tokens.weight")[rows].float()
