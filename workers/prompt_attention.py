"""A shared prompt computed once: each query runs only its own tokens, attending to the shared
prompt's cached K/V plus its own causal K/V. Causal models with "last" pooling only; a missing
shared prompt is computed in the same forward (docs/internals.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from tokq.batch import PackedBatch
from tokq.workers.layout import Layout, to_device
from tokq.workers.preempt import no_checkpoint
from tokq.workers.prompt_cache import PromptCache


@dataclass(frozen=True)
class _Bucket:
    """Sequences of similar query length attended in one SDPA call."""

    num_seqs: int
    q_len: int
    k_len: int
    q_gather: torch.Tensor  # [num_seqs*q_len] query rows; empty slots repeat one
    k_gather: torch.Tensor  # [num_seqs*k_len] rows of [shared prompt K/V ; batch K/V]
    mask: torch.Tensor  # [num_seqs, 1, q_len, k_len] additive: 0 or -inf
    real_slots: torch.Tensor  # [n] flat slots holding real query tokens
    out_rows: torch.Tensor  # [n] their rows in the batch


@dataclass
class PrefixPass:
    """One batch planned for the shared prompt path; ``attend`` is what each layer calls."""

    layout: Layout  # the tokens computed: new shared prompts first, then every query's own tokens
    num_new: int  # leading sequences of ``layout`` that are shared prompts computed in this batch
    new_keys: list  # their cache keys
    context: torch.Tensor | None  # [layers, 2, C, Hkv, D]: cached shared prompts' K/V, concatenated
    use_flash: bool
    kv_rows: torch.Tensor | None  # flash: keys of each sequence, packed [shared prompt ; own]
    cu_seqlens_k: torch.Tensor | None
    max_seqlen_q: int
    max_seqlen_k: int
    buckets: tuple[_Bucket, ...]  # sdpa
    num_tokens: int  # tokens computed (T of the forward)
    new_prefix_tokens: int  # rows 0..this of the batch: the shared prompts computed in it
    _new_cu: list[int] = field(default_factory=list)  # host copy: no device sync per layer
    _captured: list = field(default_factory=list)  # per layer: new shared prompts' (k, v) rows

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        """``[T, Hq, D]``: each sequence's queries over its shared prompt's and its own K/V."""
        num_new_rows = self.new_prefix_tokens
        if num_new_rows:
            self._captured.append((k[:num_new_rows].clone(), v[:num_new_rows].clone()))
        if self.context is not None:
            k_all = torch.cat((self.context[layer, 0], k))
            v_all = torch.cat((self.context[layer, 1], v))
        else:
            k_all, v_all = k, v
        if self.use_flash:
            from flash_attn import flash_attn_varlen_func

            return flash_attn_varlen_func(
                q, k_all.index_select(0, self.kv_rows), v_all.index_select(0, self.kv_rows),
                self.layout.cu_seqlens, self.cu_seqlens_k, self.max_seqlen_q, self.max_seqlen_k,
                softmax_scale=scale, causal=True)
        return _sdpa_buckets(q, k_all, v_all, self.buckets, scale)

    def store_new_prefixes(self, cache: PromptCache) -> None:
        """Put the shared prompts computed in this batch into the cache, one ``[layers, 2, p, Hkv, D]``
        tensor each (cloned: the cache must not hold the batch's whole K/V alive)."""
        if not self._captured:
            return
        kv = torch.stack([torch.stack(pair) for pair in self._captured])  # [L, 2, P_new, Hkv, D]
        cu = self._new_cu
        for j, key in enumerate(self.new_keys):
            cache.put(key, kv[:, :, cu[j]:cu[j + 1]].clone())
        self._captured.clear()

    def last_token_rows(self) -> torch.Tensor:
        """Row of each query's last token, in batch order."""
        return self.layout.cu_seqlens[self.num_new + 1:].long() - 1


def plan(batch: PackedBatch, cache: PromptCache, device: torch.device, dtype: torch.dtype,
         backend: str) -> PrefixPass:
    """Split ``batch`` (sequences holding their full ids, ``prompt_lens`` marking the shared
    part) into the tokens to compute and the K/V each sequence attends to."""
    cu = batch.cu_seqlens.astype(np.int64)
    lens = np.diff(cu)
    prompt_lens = batch.prompt_lens if batch.prompt_lens is not None else np.zeros_like(lens)
    ids = batch.input_ids
    num_seqs = len(lens)

    # distinct shared prompts, each looked up in the cache once per batch
    index_of: dict = {}
    prefix_ids, cached = [], []
    seq_prefix = np.full(num_seqs, -1, dtype=np.int64)
    for i in np.flatnonzero(prompt_lens).tolist():
        pid = ids[cu[i]:cu[i] + prompt_lens[i]]
        key = cache.key(pid)
        j = index_of.get(key)
        if j is None:
            j = index_of[key] = len(prefix_ids)
            prefix_ids.append(pid)
            cached.append(cache.get(key))
        seq_prefix[i] = j
    keys = list(index_of)
    new = [j for j in range(len(prefix_ids)) if cached[j] is None]
    old = [j for j in range(len(prefix_ids)) if cached[j] is not None]

    # context rows: cached shared prompts first (rows 0..C-1 of [context ; batch]), then batch rows
    ctx_start = np.zeros(len(prefix_ids), dtype=np.int64)
    offset = 0
    for j in old:
        ctx_start[j] = offset
        offset += len(prefix_ids[j])
    num_ctx = offset
    context = torch.cat([cached[j] for j in old], dim=2) if old else None

    # computed sequences: new shared prompts, then each query's own tokens
    seq_ids = [prefix_ids[j] for j in new]
    seq_start_pos = [0] * len(new)
    for i in range(num_seqs):
        p = int(prompt_lens[i])
        seq_ids.append(ids[cu[i] + p:cu[i + 1]])
        seq_start_pos.append(p)
    q_lens = np.fromiter((len(s) for s in seq_ids), dtype=np.int64, count=len(seq_ids))
    cu_q = np.zeros(len(seq_ids) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu_q[1:])
    for pos, j in enumerate(new):  # a prefix computed here: its rows in the batch
        ctx_start[j] = num_ctx + cu_q[pos]
    ctx_lens = np.zeros(len(seq_ids), dtype=np.int64)
    ctx_rows = np.zeros(len(seq_ids), dtype=np.int64)
    has = seq_prefix >= 0
    ctx_lens[len(new):][has] = prompt_lens[has]
    ctx_rows[len(new):][has] = ctx_start[seq_prefix[has]]
    own_rows = num_ctx + cu_q[:-1]

    num_tokens = int(cu_q[-1])
    positions = (np.arange(num_tokens, dtype=np.int64) - np.repeat(cu_q[:-1], q_lens)
                 + np.repeat(np.asarray(seq_start_pos, dtype=np.int64), q_lens))
    k_lens = ctx_lens + q_lens
    layout = Layout(
        input_ids=to_device(np.concatenate(seq_ids).astype(np.int64), device),
        positions=to_device(positions, device),
        cu_seqlens=to_device(cu_q.astype(np.int32), device),
        max_seqlen=int(k_lens.max()),  # the rotary tables' reach: last position + 1
        seq_index=torch.empty(0, dtype=torch.int64, device=device),  # unused: "last" pooling
        runs=(),
        restore=None,
    )
    use_flash = backend == "flash_attn"
    kv_rows = cu_k = None
    buckets: tuple[_Bucket, ...] = ()
    if use_flash:
        rows = [np.concatenate((np.arange(c0, c0 + cl), np.arange(o0, o0 + ql)))
                for c0, cl, o0, ql in zip(ctx_rows, ctx_lens, own_rows, q_lens)]
        kv_rows = to_device(np.concatenate(rows), device)
        cu_k_np = np.zeros(len(seq_ids) + 1, dtype=np.int64)
        np.cumsum(k_lens, out=cu_k_np[1:])
        cu_k = to_device(cu_k_np.astype(np.int32), device)
    else:
        buckets = _buckets(q_lens, cu_q, ctx_lens, ctx_rows, own_rows, dtype, device)
    return PrefixPass(layout=layout, num_new=len(new), new_keys=[keys[j] for j in new],
                      context=context, use_flash=use_flash, kv_rows=kv_rows, cu_seqlens_k=cu_k,
                      max_seqlen_q=int(q_lens.max()), max_seqlen_k=int(k_lens.max()),
                      buckets=buckets, num_tokens=num_tokens,
                      new_prefix_tokens=int(cu_q[len(new)]), _new_cu=cu_q[:len(new) + 1].tolist())


def _buckets(q_lens, cu_q, ctx_lens, ctx_rows, own_rows, dtype, device) -> tuple[_Bucket, ...]:
    """Sequences grouped by ceil(log2(query length)): at most 2x empty query slots, and one
    SDPA call per group instead of one per sequence."""
    tiers = np.ceil(np.log2(q_lens)).astype(np.int64)
    out = []
    for tier in np.unique(tiers).tolist():
        members = np.flatnonzero(tiers == tier)
        n, c = q_lens[members], ctx_lens[members]
        num, q_len, k_len = len(members), int(n.max()), int((n + c).max())
        j = np.arange(q_len)[None, :]
        q_real = j < n[:, None]  # [B, Lq]
        q_gather = np.where(q_real, cu_q[members][:, None] + j, cu_q[members][:, None])
        s = np.arange(k_len)[None, :]
        in_ctx = s < c[:, None]
        in_own = (s >= c[:, None]) & (s < (c + n)[:, None])
        k_gather = np.where(in_ctx, ctx_rows[members][:, None] + s,
                            np.where(in_own, own_rows[members][:, None] + s - c[:, None], 0))
        jj, ss = j[:, :, None], s[:, None, :]
        cc, nn = c[:, None, None], n[:, None, None]
        allowed = (jj < nn) & ((ss < cc) | ((ss >= cc) & (ss <= cc + jj)))
        # an empty query slot attends to slot 0 alone: finite output, never read
        allowed |= (jj >= nn) & (ss == 0)
        mask = np.where(allowed, 0.0, -np.inf).astype(np.float32)[:, None]
        real_slots = np.flatnonzero(q_real.reshape(-1))
        out.append(_Bucket(
            num_seqs=num, q_len=q_len, k_len=k_len,
            q_gather=to_device(q_gather.reshape(-1), device),
            k_gather=to_device(k_gather.reshape(-1), device),
            mask=to_device(mask, device).to(dtype),
            real_slots=to_device(real_slots, device),
            out_rows=to_device(q_gather.reshape(-1)[real_slots], device)))
    return tuple(out)


def _sdpa_buckets(q, k_all, v_all, buckets: tuple[_Bucket, ...], scale: float) -> torch.Tensor:
    num_q_heads, num_kv_heads = q.shape[1], k_all.shape[1]
    gqa = num_q_heads != num_kv_heads
    if gqa and q.is_cuda:  # CUDA SDPA's fused kernels refuse enable_gqa (math kernel: slow)
        group = num_q_heads // num_kv_heads
        k_all, v_all = k_all.repeat_interleave(group, dim=1), v_all.repeat_interleave(group, dim=1)
        gqa = False
    out = q.new_empty(q.shape)
    for b in buckets:
        qr = q.index_select(0, b.q_gather).unflatten(0, (b.num_seqs, b.q_len)).transpose(1, 2)
        kr, vr = (x.index_select(0, b.k_gather).unflatten(0, (b.num_seqs, b.k_len)).transpose(1, 2)
                  for x in (k_all, v_all))
        o = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=b.mask, scale=scale,
                                           enable_gqa=gqa).transpose(1, 2)
        out.index_copy_(0, b.out_rows, o.reshape(-1, *o.shape[2:]).index_select(0, b.real_slots))
    return out


def forward_pooled(model, batch: PackedBatch, cache: PromptCache, backend: str,
                   device: torch.device, dtype: torch.dtype,
                   checkpoint: Callable[[], None] = no_checkpoint) -> tuple[torch.Tensor, int]:
    """fp32 ``[N, hidden]`` last-token states of ``batch`` through the shared prompt path, and the
    number of tokens computed; new shared prompts enter ``cache`` after the forward, so a light
    batch nested at a ``checkpoint`` (workers/preempt.py) may use the cache too."""
    run = plan(batch, cache, device, dtype, backend)
    hidden = model.forward(run.layout, None, prefix=run, checkpoint=checkpoint)
    run.store_new_prefixes(cache)
    return hidden.index_select(0, run.last_token_rows()).float(), run.num_tokens
