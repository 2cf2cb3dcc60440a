"""Every attention backend against a per-sequence reference computed in float64: no sequence
sees a neighbour's tokens, causal masks stay inside a sequence, GQA shares kv heads right."""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import pytest
import torch

from tokq.batch import PackedBatch
from tokq.workers import attention, matmul_attention
from tokq.workers.kernels import cpu_attention, cpu_build
from tokq.host import cpu_flags
from tokq.workers.layout import build_layout

SEQ_LENS = [3, 1, 7, 3, 12, 1, 7, 20, 7, 2, 40, 70, 33, 70, 16]  # every bucket, and past them
HEAD_DIM = 16
cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
NO_CPU_VARLEN = attention.unavailable_reason("cpu_varlen", torch.device("cpu"), torch.float32)
needs_cpu_varlen = pytest.mark.skipif(bool(NO_CPU_VARLEN), reason=f"cpu_varlen: {NO_CPU_VARLEN}")


def _batch(lens=SEQ_LENS) -> PackedBatch:
    return PackedBatch.pack([np.arange(n) for n in lens])


def _qkv(num_tokens: int, num_heads: int, num_kv_heads: int, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(num_tokens, num_heads, HEAD_DIM, generator=gen)
    k = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, generator=gen)
    return (x.to(device=device, dtype=dtype) for x in (q, k, v))


def _reference(q, k, v, cu_seqlens, causal: bool, scale: float) -> torch.Tensor:
    q, k, v = (x.double().cpu() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = torch.empty_like(q)
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        qs, ks, vs = (x[start:end].transpose(0, 1) for x in (q, k, v))  # [H, L, D]
        scores = qs @ ks.transpose(1, 2) * scale
        if causal:
            n = end - start
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out[start:end] = (scores.softmax(-1) @ vs).transpose(0, 1)
    return out


def _run(backend: str, q, k, v, batch: PackedBatch, causal: bool, scale: float) -> torch.Tensor:
    """Attention in the backend's own token order, put back in the batch's order."""
    layout = build_layout(batch, q.device, backend, causal=causal, dtype=q.dtype)
    if layout.restore is None:
        return attention.attend_fn(backend)(q, k, v, layout, causal, scale)
    # the layout sorted the sequences: feed it the rows in its order, then undo it
    order = layout.restore.argsort().cpu().numpy()
    rows = np.concatenate([np.arange(batch.cu_seqlens[i], batch.cu_seqlens[i + 1]) for i in order])
    rows_t = torch.from_numpy(rows).to(q.device)
    out_sorted = attention.attend_fn(backend)(q[rows_t], k[rows_t], v[rows_t], layout, causal, scale)
    out = torch.empty_like(out_sorted)
    out[rows_t] = out_sorted
    return out


@pytest.mark.parametrize("backend", ["sdpa_packed", "sdpa_grouped", "sdpa_loop"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa2", "mqa"])
def test_cpu_backends_match_reference(backend, causal, heads):
    batch = _batch()
    q, k, v = _qkv(batch.num_tokens, *heads)
    scale = HEAD_DIM ** -0.5
    out = _run(backend, q, k, v, batch, causal, scale)
    ref = _reference(q, k, v, batch.cu_seqlens, causal, scale)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa_packed", "sdpa_grouped", "sdpa_loop"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa2"])
@pytest.mark.parametrize("max_seqlen", [attention.MATMUL_MAX_SEQLEN, 64], ids=["default", "cap64"])
def test_cpu_backends_in_bf16_match_reference_with_short_rows_through_matmul(backend, causal, heads,
                                                                             max_seqlen, monkeypatch):
    monkeypatch.setattr(attention, "MATMUL_MAX_SEQLEN", max_seqlen)
    plans = _spy_plans(monkeypatch)
    batch = _batch()
    q, k, v = _qkv(batch.num_tokens, *heads, dtype=torch.bfloat16)
    scale = HEAD_DIM ** -0.5
    out = _run(backend, q, k, v, batch, causal, scale)
    ref = _reference(q, k, v, batch.cu_seqlens, causal, scale)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    # runs up to max_seqlen slots went through the matmuls; with the cap at 64 the 70-token
    # sequences went to SDPA (outputs of both put together), by default none did
    [plan] = plans
    assert plan.blocks and max(b.seqlen for b in plan.blocks) <= max_seqlen
    assert sorted({r.seqlen for r in plan.rest}) == ([70] if max_seqlen == 64 else [])


def _fused_qkv(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype):
    """q, k, v as the model has them: strided views of one fused projection's output."""
    gen = torch.Generator().manual_seed(1)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen).to(dtype)
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    return (qkv[:, :q_end].unflatten(1, (num_heads, head_dim)),
            qkv[:, q_end:k_end].unflatten(1, (num_kv_heads, head_dim)),
            qkv[:, k_end:].unflatten(1, (num_kv_heads, head_dim)))


@needs_cpu_varlen
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa2", "mqa"])
# d32/d64: the vector path (bf16: the dot-product path where the CPU has it); d24: generic
@pytest.mark.parametrize("head_dim", [32, 64, 24], ids=["d32", "d64", "d24"])
def test_cpu_varlen_matches_reference(dtype, causal, heads, head_dim):
    batch = _batch(SEQ_LENS + [200])  # 200: keys over many 16-key blocks
    q, k, v = _fused_qkv(batch.num_tokens, *heads, head_dim, dtype)
    scale = head_dim ** -0.5
    out = _run("cpu_varlen", q, k, v, batch, causal, scale)
    ref = _reference(q, k, v, batch.cu_seqlens, causal, scale)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@needs_cpu_varlen
def test_cpu_varlen_takes_bf16_dot_products_where_the_cpu_has_them():
    """The build follows the CPU: a regression in flags or feature tests would quietly fall back
    to the slower fp32 path."""
    has = {"avx512_bf16", "avx512bw"} <= cpu_flags()
    assert cpu_attention.bf16_dot_products(32) == has
    assert cpu_attention.bf16_dot_products(128) == has
    assert not cpu_attention.bf16_dot_products(24)  # not whole vectors of pairs: generic path


@needs_cpu_varlen
def test_cpu_varlen_built_without_bf16_dot_products_rounds_every_output_correctly():
    """The comparison build (``WITHOUT_DOT_PRODUCTS``, the bench's baseline) takes the fp32-math
    path: each bf16 output within half a bf16 step of the exact value."""
    flags = cpu_attention.WITHOUT_DOT_PRODUCTS
    path = cpu_build.function("cpu_attention", "tokq_varlen_bf16_dot_products", (ctypes.c_int,), flags)
    assert path(32) == 0
    batch = _batch(SEQ_LENS + [200])
    q, k, v = _fused_qkv(batch.num_tokens, 4, 2, 32, torch.bfloat16)
    out = cpu_attention.attend(q, k, v, torch.tensor(batch.cu_seqlens), False, 0.2, extra_flags=flags)
    ref = _reference(q, k, v, batch.cu_seqlens, False, 0.2)
    assert ((out.double() - ref).abs() <= ref.abs() * 2.0 ** -8 + 1e-6).all()


@needs_cpu_varlen
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_cpu_varlen_never_reads_past_a_sequence_of_odd_length(causal):
    """bf16 pairs keys two by two; an odd-length sequence's last pair must not take in the next
    sequence's row (with weight 0: NaN times 0 is NaN)."""
    batch = _batch([3, 5, 1, 17])
    q, k, v = _fused_qkv(batch.num_tokens, 2, 2, 32, torch.bfloat16)
    for start in batch.cu_seqlens[1:-1]:  # each next sequence's first row
        v[start] = float("nan")
        k[start] = float("nan")
    out = _run("cpu_varlen", q, k, v, batch, causal, 0.2)
    ref = _reference(q, k, v, batch.cu_seqlens, causal, 0.2)
    first = batch.cu_seqlens[1]
    assert not out[:first].isnan().any()
    torch.testing.assert_close(out[:first].double(), ref[:first], atol=1e-2, rtol=1e-2)


@needs_cpu_varlen
def test_cpu_varlen_gives_the_same_bits_on_any_number_of_threads():
    batch = _batch()
    q, k, v = _fused_qkv(batch.num_tokens, 4, 2, 32, torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run("cpu_varlen", q, k, v, batch, True, 0.2)
        for threads in (2, 4):  # the 2 kv heads split; with 4, the sequences in two too
            torch.set_num_threads(threads)
            assert torch.equal(_run("cpu_varlen", q, k, v, batch, True, 0.2), one)
    finally:
        torch.set_num_threads(threads)


def _spy_plans(monkeypatch) -> list:
    plans, build = [], matmul_attention.build_plan

    def spy(*args):
        plans.append(build(*args))
        return plans[-1]

    monkeypatch.setattr(matmul_attention, "build_plan", spy)
    return plans


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa2"])
def test_matmul_attention_reads_fused_qkv_views_and_plans_once_per_batch(causal, heads, monkeypatch):
    """q, k, v as the models pass them: views of one fused projection (BERT) or q, k fresh and
    v a view (Qwen after RoPE); every layer after the first reuses the first one's plan."""
    plans = _spy_plans(monkeypatch)
    batch = _batch()
    num_heads, num_kv_heads = heads
    width = num_heads + 2 * num_kv_heads
    fused = torch.randn(batch.num_tokens, width, HEAD_DIM,
                        generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    q, k, v = fused.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    layout = build_layout(batch, q.device, "sdpa_packed", causal=causal, dtype=q.dtype)
    attend = attention.attend_fn("sdpa_packed")
    order = layout.restore.argsort().numpy() if layout.restore is not None else np.arange(len(SEQ_LENS))
    rows = torch.from_numpy(np.concatenate([np.arange(batch.cu_seqlens[i], batch.cu_seqlens[i + 1])
                                            for i in order]))
    fused_sorted = fused[rows]  # the layout's token order, still one fused tensor
    qs, ks, vs = fused_sorted.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    cu_sorted = np.concatenate([[0], np.cumsum(batch.seqlens[order])])
    ref = _reference(qs, ks, vs, cu_sorted, causal, 0.25)
    for q_in, k_in in ((qs, ks), (qs.contiguous(), ks.contiguous()), (qs, ks)):
        out = attend(q_in, k_in, vs, layout, causal, 0.25)
        torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    assert len(plans) == 2  # one per memory layout of q, k, v; the third call reused the first
    assert len(layout.plans) == 2


def test_grouped_layout_sorts_by_length_and_restores_batch_order():
    batch = _batch([5, 2, 5, 1])
    layout = build_layout(batch, torch.device("cpu"), "sdpa_grouped")
    assert [(r.start, r.num_seqs, r.seqlen) for r in layout.runs] == [(0, 1, 1), (1, 1, 2), (3, 2, 5)]
    assert layout.cu_seqlens.tolist() == [0, 1, 3, 8, 13]
    assert layout.restore.tolist() == [2, 1, 3, 0]  # sorted rows of sequences 0, 1, 2, 3
    assert layout.seq_index.tolist() == [0, 1, 1] + [2] * 5 + [3] * 5
    # tokens and positions travel with their sequence
    assert layout.input_ids.tolist()[:3] == [0, 0, 1]
    assert layout.positions.tolist() == [0, 0, 1, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4]


def test_packed_layout_puts_short_sequences_side_by_side_in_rows():
    batch = _batch([5, 70, 2, 30, 40, 3])
    layout = build_layout(batch, torch.device("cpu"), "sdpa_packed")
    assert layout.input_ids.shape[0] == batch.num_tokens  # no pad outside attention
    runs = [(r.start, r.num_seqs, r.seqlen, r.num_tokens, r.gather is not None) for r in layout.runs]
    # sorted lengths 2, 3, 5 | 30 | 40 | 70 (rows 0-1, 2-4, 5-9, 10-39, ...): best fit, longest
    # first, fills rows of 32 slots as [30, 2] and [5, 3]; a row of 64 holds [40]; 70 is past
    # the rows and attends on its own
    assert runs == [(0, 2, 32, 40, True), (40, 1, 64, 40, True), (80, 1, 70, 70, False)]
    rows = layout.runs[0]
    gather, allowed = rows.gather.view(2, 32), rows.mask[:, 0] == 0
    assert gather[0].tolist() == list(range(10, 40)) + [0, 1]
    assert gather[1, :8].tolist() == [5, 6, 7, 8, 9, 2, 3, 4]
    # block diagonal: the 3-token sequence at slots 5..7 of row 1 sees exactly slots 5..7
    assert allowed[1, 6].nonzero().flatten().tolist() == [5, 6, 7]
    assert allowed[0, 31].nonzero().flatten().tolist() == [30, 31]
    assert allowed[1, 20].nonzero().flatten().tolist() == [20]  # an empty slot sees only itself
    assert (rows.gather[rows.scatter] == torch.arange(40)).all()


def test_best_fit_packing_fills_rows_next_fit_would_leave_half_empty():
    # sorted: 10 x 3, then 17 x 3; next fit: [10 10 10] then one 17 per row (4 rows); best fit
    # longest first: [17 10] x 3, then [17]
    layout = build_layout(_batch([17, 10, 17, 10, 17, 10]), torch.device("cpu"), "sdpa_packed")
    [run] = layout.runs
    assert (run.num_seqs, run.seqlen, run.num_tokens) == (3, 32, 81)
    # sorted token rows: the 10s at 0, 10, 20, the 17s at 30, 47, 64
    gather = run.gather.view(3, 32)[:, :27].tolist()
    assert gather == [list(range(30, 47)) + list(range(20, 30)), list(range(47, 64)) + list(range(10, 20)),
                      list(range(64, 81)) + list(range(0, 10))]
    assert (run.gather[run.scatter] == torch.arange(81)).all()


def test_packed_causal_mask_stays_inside_each_sequence():
    layout = build_layout(_batch([3, 2]), torch.device("cpu"), "sdpa_packed", causal=True)
    allowed = layout.runs[0].mask[0, 0] == 0  # slots: [3-token seq][2-token seq]
    assert allowed[:5, :5].int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0],
                                               [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]


def test_already_sorted_batch_is_not_copied():
    layout = build_layout(_batch([1, 2, 2, 9]), torch.device("cpu"), "sdpa_grouped")
    assert layout.restore is None
    assert [(r.num_seqs, r.seqlen) for r in layout.runs] == [(1, 1), (2, 2), (1, 9)]


def test_auto_backend_on_cpu_is_the_c_kernel_else_packed_sdpa(monkeypatch):
    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16):
        expected = "sdpa_packed" if NO_CPU_VARLEN else "cpu_varlen"
        assert attention.choose_backend("auto", cpu, dtype) == expected
    # no compiler: auto falls back, and asking for the kernel says why not
    monkeypatch.setattr(cpu_build, "compiler", lambda: None)
    monkeypatch.setattr(cpu_build, "library", functools.cache(cpu_build.library.__wrapped__))
    assert attention.choose_backend("auto", cpu, torch.float32) == "sdpa_packed"
    with pytest.raises(ValueError, match="no C compiler"):
        attention.choose_backend("cpu_varlen", cpu, torch.float32)


@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen"])
def test_gpu_backend_requested_on_cpu_says_why_not(backend):
    with pytest.raises(ValueError, match="needs a CUDA device"):
        attention.choose_backend(backend, torch.device("cpu"), torch.float32)


def test_unknown_backend_lists_the_known_ones():
    with pytest.raises(ValueError, match="sdpa_grouped"):
        attention.choose_backend("xformers", torch.device("cpu"), torch.float32)


@cuda
@needs_cuda
@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen", "sdpa_packed"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_cuda_backends_match_reference_in_bf16(backend, causal):
    device = torch.device("cuda")
    reason = attention.unavailable_reason(backend, device, torch.bfloat16)
    if reason:
        pytest.skip(reason)
    batch = _batch(SEQ_LENS + [300, 129])
    q, k, v = _qkv(batch.num_tokens, 8, 2, dtype=torch.bfloat16, device=device)
    scale = HEAD_DIM ** -0.5
    out = _run(backend, q, k, v, batch, causal, scale)
    ref = _reference(q, k, v, batch.cu_seqlens, causal, scale)
    torch.testing.assert_close(out.double().cpu(), ref, atol=2e-2, rtol=2e-2)


@needs_cpu_varlen
def test_cpu_varlen_takes_empty_sequences_and_an_empty_batch():
    q, k, v = _qkv(7, 2, 2)
    cu = torch.tensor([0, 0, 3, 3, 7], dtype=torch.int32)  # two empty sequences among them
    out = cpu_attention.attend(q, k, v, cu, False, 0.25)
    torch.testing.assert_close(out.double(), _reference(q, k, v, cu.tolist(), False, 0.25),
                               atol=1e-5, rtol=1e-5)
    none = cpu_attention.attend(q[:0], k[:0], v[:0], torch.tensor([0, 0], dtype=torch.int32),
                                False, 0.25)
    assert none.shape == (0, 2, HEAD_DIM)


@needs_cpu_varlen
def test_cpu_varlen_builds_into_tokq_cache_dir_and_falls_back_when_it_cannot(monkeypatch, tmp_path):
    def fresh_library():  # the build as a new worker process would do it
        monkeypatch.setattr(cpu_build, "library", functools.cache(cpu_build.library.__wrapped__))

    monkeypatch.setenv("TOKQ_CACHE_DIR", str(tmp_path / "cache"))
    fresh_library()
    assert attention.unavailable_reason("cpu_varlen", torch.device("cpu"), torch.float32) is None
    [built] = (tmp_path / "cache").glob("cpu_attention-*.so")
    q, k, v = _qkv(5, 2, 2)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    torch.testing.assert_close(cpu_attention.attend(q, k, v, cu, False, 0.3).double(),
                               _reference(q, k, v, cu.tolist(), False, 0.3), atol=1e-5, rtol=1e-5)
    # a cache that cannot be written (a file where the directory would go): the torch backends
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TOKQ_CACHE_DIR", str(tmp_path / "file"))
    fresh_library()
    assert attention.choose_backend("auto", torch.device("cpu"), torch.float32) == "sdpa_packed"
    assert "failed" in attention.unavailable_reason("cpu_varlen", torch.device("cpu"), torch.float32)
