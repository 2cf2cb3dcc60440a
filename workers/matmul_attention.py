"""CPU attention in bf16/fp16 for the short runs of a sorted layout (``SeqRun``s of at most
``max_seqlen`` slots): plain batched matmuls + softmax, where SDPA's CPU flash kernel's fixed
costs dominate. All runs of a layer share one gather and one scatter (docs/internals.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokq.workers.layout import Layout, SeqRun


@dataclass(frozen=True)
class _Block:
    """One run's slots as ``[rows, seqlen, D]`` matrices: ``rows`` = num_seqs * Hq."""

    rows: int
    seqlen: int
    offset: int  # first row ([., D] rows) of the block in the gathered q, k, v and the output
    mask: torch.Tensor | None  # additive, [key, query], broadcastable to [rows, seqlen, seqlen]


@dataclass(frozen=True)
class MatmulPlan:
    """What every layer's matmul attention reads, for one batch and one head layout."""

    gathers: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # rows of q, k, v in block order
    blocks: tuple[_Block, ...]
    out_rows: torch.Tensor  # [n*Hq]: output-buffer row of each (token, head), token order
    tokens: torch.Tensor | None  # [n] the tokens these runs hold; None: all, in order
    rest: tuple[SeqRun, ...]  # runs longer than the plan's max_seqlen, left to SDPA


def _row_stride(x: torch.Tensor) -> int | None:
    """Rows of D elements between consecutive tokens of ``[T, H, D]`` ``x`` when its heads sit
    side by side in memory (a view of a fused qkv projection, or contiguous); else None."""
    head_dim = x.shape[-1]
    if x.stride(2) != 1 or x.stride(1) != head_dim or x.stride(0) % head_dim:
        return None
    return x.stride(0) // head_dim


def _rows(x: torch.Tensor, stride: int) -> torch.Tensor:
    """``[T, H, D]`` ``x`` as a ``[rows, D]`` view in which token t's head h is row t*stride + h."""
    num_rows = (x.shape[0] - 1) * stride + x.shape[1] if x.shape[0] else 0
    return torch.as_strided(x, (num_rows, x.shape[-1]), (x.shape[-1], 1))


def build_plan(layout: Layout, strides: tuple[int, int, int], num_heads: int, num_kv_heads: int,
               causal: bool, max_seqlen: int, dtype: torch.dtype) -> MatmulPlan:
    """The plan for the runs of ``layout`` of at most ``max_seqlen`` slots; q, k, v rows
    ``strides`` apart (``_row_stride``)."""
    runs = [run for run in layout.runs if run.seqlen <= max_seqlen]
    rest = tuple(run for run in layout.runs if run.seqlen > max_seqlen)
    heads = np.arange(num_heads)
    head_maps = (heads, heads // (num_heads // num_kv_heads), heads // (num_heads // num_kv_heads))
    slot_tokens, out_rows, tokens, blocks, offset = [], [], [], [], 0
    for run in runs:
        rows, seqlen = run.num_seqs, run.seqlen
        if run.gather is None:  # equal lengths: slot s of sequence b is token start + b*L + s
            slot_token = np.arange(run.start, run.start + run.num_tokens).reshape(rows, seqlen)
            slot = np.arange(run.num_tokens)
        else:
            slot_token = run.gather.cpu().numpy().reshape(rows, seqlen)
            slot = run.scatter.cpu().numpy()
        slot_tokens.append(slot_token)
        row, pos = slot // seqlen, slot % seqlen
        out_rows.append(offset + (row[:, None] * num_heads + heads[None]) * seqlen + pos[:, None])
        tokens.append(np.arange(run.start, run.start + run.num_tokens))
        # masks [key, query], as the scores are laid out (``attend``)
        if run.mask is not None:  # packed rows: the block-diagonal mask, one copy per head
            mask = (run.mask.to(dtype).transpose(-1, -2).expand(rows, num_heads, seqlen, seqlen)
                    .reshape(-1, seqlen, seqlen))
        elif causal and seqlen > 1:
            mask = torch.full((seqlen, seqlen), float("-inf"), dtype=dtype).tril(-1)
        else:
            mask = None
        blocks.append(_Block(rows * num_heads, seqlen, offset, mask))
        offset += rows * num_heads * seqlen
    gathers = tuple(
        torch.from_numpy(np.concatenate([(t[:, None, :] * stride + head_map[None, :, None]).reshape(-1)
                                         for t in slot_tokens]) if slot_tokens else np.zeros(0, np.int64))
        for stride, head_map in zip(strides, head_maps))
    all_tokens = np.concatenate(tokens) if tokens else np.zeros(0, np.int64)
    in_order = len(all_tokens) == int(layout.input_ids.shape[0]) and (all_tokens == np.arange(len(all_tokens))).all()
    return MatmulPlan(
        gathers=gathers,
        blocks=tuple(blocks),
        out_rows=torch.from_numpy(np.concatenate(out_rows).reshape(-1) if out_rows else np.zeros(0, np.int64)),
        tokens=None if in_order else torch.from_numpy(all_tokens),
        rest=rest)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout, causal: bool,
           scale: float, max_seqlen: int, out: torch.Tensor) -> tuple[SeqRun, ...]:
    """Fill ``out`` ``[T, Hq, D]`` at the tokens of every run of at most ``max_seqlen`` slots;
    return the other runs."""
    q, k, v = (x if _row_stride(x) is not None else x.contiguous() for x in (q, k, v))
    strides = (_row_stride(q), _row_stride(k), _row_stride(v))
    num_heads, head_dim = q.shape[1], q.shape[2]
    key = ("matmul", strides, num_heads, k.shape[1], causal, max_seqlen)
    plan = layout.plans.get(key)
    if plan is None:
        plan = layout.plans[key] = build_plan(layout, strides, num_heads, k.shape[1], causal, max_seqlen,
                                              q.dtype)
    if not plan.blocks:
        return plan.rest
    qg, kg, vg = (_rows(x, stride).index_select(0, gather)
                  for x, stride, gather in zip((q, k, v), strides, plan.gathers))
    o, zero = q.new_empty(qg.shape), q.new_zeros(())
    for block in plan.blocks:
        rows = slice(block.offset, block.offset + block.rows * block.seqlen)
        qb, kb, vb = (x[rows].view(block.rows, block.seqlen, head_dim) for x in (qg, kg, vg))
        # Scores [key, query]: softmax over dim -2 is vectorized across queries by torch's CPU
        # kernel. No mask: beta=0 ignores the input and the scale lands in the fp32 accumulator.
        square = (block.rows, block.seqlen, block.seqlen)
        mask, beta = (block.mask, 1) if block.mask is not None else (zero.expand(square), 0)
        scores = torch.baddbmm(mask, kb, qb.transpose(1, 2), beta=beta, alpha=scale)
        torch.bmm(torch.softmax(scores, -2).transpose(1, 2), vb,
                  out=o[rows].view(block.rows, block.seqlen, head_dim))
    if plan.tokens is None:  # every token, in order: straight into out
        torch.index_select(o, 0, plan.out_rows, out=out.view(-1, head_dim))
    else:
        out.index_copy_(0, plan.tokens, o.index_select(0, plan.out_rows).view(-1, num_heads, head_dim))
    return plan.rest
