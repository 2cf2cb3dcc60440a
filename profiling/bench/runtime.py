"""Packed (varlen) runtime against sentence-transformers on a short-query workload, same process,
systems interleaved round by round so load from other work hits all of them.

    tokq bench runtime [--num-queries 800] [--rounds 3] [--dtype auto|float32|bfloat16] [--threads N]
        [--results-md profiling/results/model.md]

Prints tokens/s (real tokens, median over rounds) of: the packed runtime at each token budget,
queries packed in arrival order; sentence-transformers one query at a time and in padded batches
of 32; each CPU attention backend and F.linear (MKL) instead of oneDNN at a 1,024-token budget; in
bf16, SDPA's kernel for every row (no matmul path for short rows); each as ratios to
sentence-transformers and as fractions of the fp32 matmul peak timed right before it, through
torch.mm (MKL) and through oneDNN. "Linear limit" = peak / (2 FLOPs per linear weight); "MFU" =
all model FLOPs / peak. Then the runtime's own ceiling in its dtype: the model's linear layers
alone through the same kernels on the same shapes, with and without the epilogues the forward
fuses into them; the forward's time by part and by op; one layer's attention alone per backend.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import click
import numpy as np
import torch

from tokq.batch import PackedBatch
from tokq.profiling.results_md import block, command_line, machine_cores, write_block

BUDGETS = (256, 512, 1024, 2048, 4096)
ST_BATCH = 32
# cpu_varlen's vector widths (workers/kernels/cpu_vec.h): the native one runs; the others are timed
# beside it, built with -DLANES (wider than the registers: lowered by the compiler).
VECTOR_WIDTHS = (4, 8, 16)
CPU_BACKENDS = ("cpu_varlen", "sdpa_packed", "sdpa_grouped", "sdpa_loop")
LINEAR = "linear layers (epilogues included)"
FORWARD_SIZES = (1, 2, 4, 12, 32, 64, 128, 256, 512, 1024)  # batch tokens of the forward-cost table
ONE_QUERY_MAX, PACKED_QUERY = 32, 12  # a batch is one query up to ONE_QUERY_MAX tokens, else 12-token queries


def block_name(dtype: str) -> str:
    """One block per ``--dtype`` and CPU vector extension."""
    from tokq.host import vector_extension

    return f"tokq bench runtime ({dtype}, {vector_extension()})"


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def load_engines(model: str | None, variants: dict[str, dict]):
    """One CPU Engine per label, loaded with its own ``Engine.load`` arguments and run once; a
    variant this machine cannot run is left out, with why."""
    from tokq.workers.engine import Engine

    engines, skipped = {}, {}
    for label, kwargs in variants.items():
        try:
            engines[label] = Engine.load(model, device="cpu", **kwargs)
            engines[label].embed(PackedBatch.pack([[1, 2, 3]]))
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            skipped[label] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            engines.pop(label, None)
    return engines, skipped


def pack_in_order(ids, budget: int) -> list[PackedBatch]:
    """Arrival order, a new batch whenever the next query would pass the budget."""
    batches, current, num_tokens = [], [], 0
    for seq in ids:
        if current and num_tokens + len(seq) > budget:
            batches.append(PackedBatch.pack(current))
            current, num_tokens = [], 0
        current.append(seq)
        num_tokens += len(seq)
    return batches + ([PackedBatch.pack(current)] if current else [])


def forward_costs(engines: dict, onnx, sizes, rounds: int, repeats: int = 5) -> list[str]:
    """Forward ms and tokens/s against batch tokens, per engine and for ONNX Runtime (``onnx``: an
    OnnxSentenceEncoder or None) on one query of the same tokens; medians over interleaved rounds."""
    rng, first = np.random.default_rng(0), next(iter(engines.values()))
    vocab, max_len = first.info.config.get("vocab_size", 30522), first.info.max_length
    names = [*engines, *(["ONNX Runtime (float32), one query"] if onnx else [])]
    rows = []
    for n in sizes:
        size = n if n <= ONE_QUERY_MAX else PACKED_QUERY
        batch = PackedBatch.pack([rng.integers(1000, vocab, min(size, n - i)).tolist() for i in range(0, n, size)])
        fns = {name: (lambda e=e: e.embed(batch)) for name, e in engines.items()}
        if onnx and n <= max_len:
            ids = rng.integers(1000, vocab, (1, n))
            feed = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
            feed = {i.name: feed[i.name] for i in onnx.session.get_inputs()}
            fns[names[-1]] = lambda f=feed: onnx.session.run(["last_hidden_state"], f)[0].mean(1)
        ms = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                fn()
                ms[name].append(1e3 * statistics.median(timed(fn) for _ in range(repeats)))
        cells = [(f"{statistics.median(ms[k]):.2f}", f"{1e3 * n / statistics.median(ms[k]):,.0f}") if k in ms
                 else ("–", "–") for k in names]
        rows.append(f"| {n} ({batch.num_seqs} quer{'y' if batch.num_seqs == 1 else 'ies'}) | "
                    + " | ".join(c for pair in cells for c in pair) + " |")
    return ["| batch tokens | " + " | ".join(f"{k} ms | {k} tokens/s" for k in names) + " |",
            "|---|" + "---:|" * 2 * len(names), *rows]


def onnx_encoder(model_dir, export_dir: str, max_len: int):
    """ONNX Runtime on the model's ONNX export (profiling/bench/baselines/onnx_model.py), on torch's
    thread count; None, with why, where it cannot run."""
    try:
        from tokq.profiling.bench.baselines.onnx_model import OnnxSentenceEncoder, export

        export(model_dir, Path(export_dir))
        return OnnxSentenceEncoder(export_dir, threads=torch.get_num_threads(), max_seq_length=max_len), ""
    except (ImportError, RuntimeError, OSError) as exc:
        return None, f"{type(exc).__name__}: {exc}".splitlines()[0]


def matmul_peak_flops(size: int = 2048, repeats: int = 3) -> tuple[float, float]:
    """Median fp32 FLOP/s of a large matmul through torch.mm (MKL) and through the oneDNN linear
    the runtime uses (0 when absent): the CPU's practical peaks."""
    from tokq.workers.models.layers import OneDnnLinear, _onednn_works

    a, b = torch.randn(size, size), torch.randn(size, size)
    kernels = [lambda: torch.mm(a, b)] + ([lambda: OneDnnLinear()(a, b)] if _onednn_works() else [])
    peaks = []
    for kernel in kernels:
        kernel()
        peaks.append(2 * size**3 / statistics.median(timed(kernel) for _ in range(repeats)))
    return peaks[0], (peaks[1] if len(peaks) > 1 else 0.0)


def linear_calls(engine, num_tokens: int = 1024) -> list[tuple]:
    """(x, weight, bias) for every 2-d weight of every layer, on ``num_tokens`` rows in the engine's dtype."""
    gen, calls = torch.Generator().manual_seed(0), []
    for layer in engine.model.layers:
        for name, weight in vars(layer).items():
            if isinstance(weight, torch.Tensor) and weight.dim() == 2:
                bias = getattr(layer, name.removesuffix("_weight") + "_bias", None)
                calls.append((torch.randn(num_tokens, weight.shape[1], generator=gen).to(engine.dtype), weight, bias))
    return calls


def _tokens_per_s(calls: list[tuple[Callable, tuple]], num_tokens: int, repeats: int) -> float:
    @torch.inference_mode()
    def run() -> None:
        for fn, args in calls:
            fn(*args)
    run()
    return num_tokens / statistics.median(timed(run) for _ in range(repeats))


def linear_only_tokens_per_s(engine, num_tokens: int = 1024, repeats: int = 5) -> float:
    """Tokens/s of the model's linear layers alone through the engine's kernels: the ceiling."""
    return _tokens_per_s([(engine.model.linear, c) for c in linear_calls(engine, num_tokens)], num_tokens, repeats)


def forward_linear_calls(engine, num_tokens: int = 1024) -> list[tuple[Callable, tuple]]:
    """The forward's own linear calls, in order and through its own kernel methods (with the
    epilogues it fuses: activation; the residual add, unless the model's C norms do it), recorded
    over one small batch and given ``num_tokens``-row random inputs in the engine's dtype."""
    model, gen = engine.model, torch.Generator().manual_seed(0)
    kernel, recorded = model.linear, []

    def rand(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen).to(engine.dtype)

    class Recorder:
        name = kernel.name

        def __call__(self, x, weight, bias=None):
            recorded.append((kernel, (rand(num_tokens, weight.shape[1]), weight, bias)))
            return kernel(x, weight, bias)

        def act(self, x, weight, bias, act_name):
            recorded.append((kernel.act, (rand(num_tokens, weight.shape[1]), weight, bias, act_name)))
            return kernel.act(x, weight, bias, act_name)

        def add(self, x, weight, bias, residual):
            recorded.append((kernel.add, (rand(num_tokens, weight.shape[1]), weight, bias,
                                          rand(num_tokens, weight.shape[0]))))
            return kernel.add(x, weight, bias, residual)

    # A small batch's BERT layers may run in one C call (fused_rows), past any linear call: off here.
    fused_rows = getattr(model, "fused_rows", 0)
    model.linear = Recorder()
    if fused_rows:
        model.fused_rows = 0
    try:
        engine.embed(PackedBatch.pack([[1, 2, 3]]))
    finally:
        model.linear = kernel
        if fused_rows:
            model.fused_rows = fused_rows
    return recorded


def fused_epilogues(engine) -> str:
    """What the forward fuses into its linear layers, in words ("activation, residual add")."""
    kinds = {getattr(fn, "__name__", "") for fn, _ in forward_linear_calls(engine, num_tokens=1)}
    return ", ".join(w for kind, w in (("act", "activation"), ("add", "residual add")) if kind in kinds) or "none"


def forward_linears_tokens_per_s(engine, num_tokens: int = 1024, repeats: int = 5) -> float:
    """Tokens/s of the forward's linear calls with their epilogues: the most the forward reaches."""
    return _tokens_per_s(forward_linear_calls(engine, num_tokens), num_tokens, repeats)


def time_split(engine, batches: list[PackedBatch]) -> dict[str, float]:
    """Seconds the forwards over ``batches`` spend in the linear calls (epilogues included), in
    attention, and in everything else, timed by wrapping the engine's own linear kernel and
    attention function (no profiler overhead)."""
    model, kernel, attend = engine.model, engine.model.linear, engine._attend
    spent = {LINEAR: 0.0, "attention": 0.0}

    def clocked(part: str, fn: Callable) -> Callable:
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[part] += time.perf_counter() - start
        return run

    class ClockedLinear:
        name = kernel.name
        __call__, act, add = (staticmethod(clocked(LINEAR, f)) for f in (kernel, kernel.act, kernel.add))

    model.linear, engine._attend = ClockedLinear(), clocked("attention", attend)
    try:
        total = timed(lambda: [engine.embed(batch) for batch in batches])
    finally:
        model.linear, engine._attend = kernel, attend
    return {**spent, "everything else (embedding, norms, layout, pooling)": total - sum(spent.values())}


def op_table(engine, batches: list[PackedBatch], row_limit: int = 14) -> str:
    """The torch profiler's per-op table (self CPU time); the C kernels run through ctypes, not
    as torch ops, so their time is not in it."""
    from torch.profiler import ProfilerActivity, profile

    for batch in batches[:2]:
        engine.embed(batch)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for batch in batches:
            engine.embed(batch)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=row_limit)


@contextlib.contextmanager
def sdpa_kernel_only():
    """The sdpa backends without their matmul path for short rows (attention.MATMUL_MAX_SEQLEN)."""
    from tokq.workers import attention

    saved, attention.MATMUL_MAX_SEQLEN = attention.MATMUL_MAX_SEQLEN, 0
    try:
        yield
    finally:
        attention.MATMUL_MAX_SEQLEN = saved


def attention_ms_per_layer(engine, batches: list[PackedBatch], backend: str, repeats: int = 5, attend=None) -> float:
    """Median ms of one layer's attention per batch with ``backend`` (random q, k, v of the model's
    shape and dtype; layouts built once, as the engine does per batch), or with ``attend``."""
    from tokq.workers import attention
    from tokq.workers.layout import build_layout

    model, gen = engine.model, torch.Generator().manual_seed(0)
    layouts = [build_layout(b, engine.device, backend, causal=model.causal, dtype=engine.dtype) for b in batches]
    qkvs = [torch.randn(b.num_tokens, 3, model.num_heads, model.head_dim, generator=gen).to(engine.dtype)
            for b in batches]
    attend, scale = attend or attention.attend_fn(backend), model.head_dim ** -0.5

    def run() -> None:
        for layout, qkv in zip(layouts, qkvs):
            attend(qkv[:, 0], qkv[:, 1], qkv[:, 2], layout, model.causal, scale)
    run()
    return 1e3 * statistics.median(timed(run) for _ in range(repeats)) / len(batches)


def measure(say, *, num_queries: int, rounds: int, token_budgets: list[int], workload: str | None,
            model: str | None, dtype: str) -> None:
    from sentence_transformers import SentenceTransformer

    from tokq.host import cpu_name, vector_extension
    from tokq.model.flops import linear_flops_per_token
    from tokq.profiling.bench.loadgen import load_queries
    from tokq.workers import attention
    from tokq.workers.engine import Engine
    from tokq.workers.kernels import cpu_attention, cpu_build

    engine = Engine.load(model, device="cpu", dtype=dtype)  # what auto picks
    # the alternatives auto did not pick, each changing one thing
    variants = {b: {"dtype": dtype, "attn_backend": b} for b in CPU_BACKENDS if b != engine.attn_backend}
    variants["F.linear"] = {"dtype": dtype, "linear": "torch"}
    if engine.dtype != torch.float32:
        variants["fp32"] = {"dtype": "float32"}
    engines, skipped = load_engines(model, variants)
    for label, why in skipped.items():
        say(f"{label}: not measured ({why})")
    st = SentenceTransformer(str(engine.info.path), device="cpu")
    queries, source = load_queries(workload, num_queries, seed=1)
    texts = [q.text for q in queries[:num_queries]]
    ids = st.tokenizer(texts, truncation=True, max_length=engine.info.max_length)["input_ids"]
    num_tokens = sum(len(s) for s in ids)
    systems: dict[str, Callable[[], object]] = {
        "st one at a time": lambda: [st.encode([t], batch_size=1) for t in texts],
        f"st batch {ST_BATCH}": lambda: st.encode(texts, batch_size=ST_BATCH)}
    flops: dict[str, float] = {}
    for budget in token_budgets:
        batches = pack_in_order(ids, budget)
        systems[f"packed {budget}"] = lambda b=batches: [engine.embed(x) for x in b]
        flops[f"packed {budget}"] = sum(engine.batch_flops(x) for x in batches)
    backend_batches = pack_in_order(ids, 1024)
    backend_flops = sum(engine.batch_flops(x) for x in backend_batches)
    for label, eng in engines.items():
        systems[f"packed 1024 {label}"] = lambda e=eng: [e.embed(x) for x in backend_batches]
        flops[f"packed 1024 {label}"] = backend_flops
    if engine.dtype != torch.float32 and engine.attn_backend.startswith("sdpa"):
        def sdpa_only() -> None:
            with sdpa_kernel_only():
                [engine.embed(x) for x in backend_batches]
        systems["packed 1024 SDPA kernel only"], flops["packed 1024 SDPA kernel only"] = sdpa_only, backend_flops

    dot_products = (engine.attn_backend == "cpu_varlen" and engine.dtype == torch.bfloat16
                    and cpu_attention.bf16_dot_products(engine.model.head_dim))
    width = f", {cpu_build.vector_lanes('cpu_attention')} floats a vector" if engine.attn_backend == "cpu_varlen" else ""
    say(f"model {engine.info.name}, {str(engine.dtype).removeprefix('torch.')}, attention {engine.attn_backend}"
        f"{' (bf16 dot products)' if dot_products else ''}{width}, linear {engine.linear_backend}; torch "
        f"{torch.__version__}; {cpu_name()} ({vector_extension()}), {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    say(f"workload: {source}: {len(texts)} queries, {num_tokens} tokens "
        f"(p50 {np.median([len(s) for s in ids]):.0f}, max {max(len(s) for s in ids)})")
    for eng in [*engines.values(), engine]:
        eng.warmup(max(token_budgets))
    st.encode(texts[:ST_BATCH], batch_size=ST_BATCH)

    # per round: each system timed right after its own peak and limit measurements, so a change in
    # load from other work moves both; every figure is a median over rounds of per-round values
    rates, peaks, limits = ({name: [] for name in systems} for _ in range(3))
    epilogue_shares, splits = [], []  # fused / plain linear layers; packed 1024's time by part
    num_backend_tokens = sum(batch.num_tokens for batch in backend_batches)
    for round_index in range(rounds):
        for name, fn in systems.items():
            peaks[name].append(matmul_peak_flops())
            limits[name].append(linear_only_tokens_per_s(engine))
            rates[name].append(num_tokens / timed(fn))
        epilogue_shares.append(forward_linears_tokens_per_s(engine) / linear_only_tokens_per_s(engine))
        limit_s = num_backend_tokens / linear_only_tokens_per_s(engine)
        splits.append({part: seconds / limit_s for part, seconds in time_split(engine, backend_batches).items()})
        say(f"round {round_index + 1}/{rounds} done, load average {os.getloadavg()[0]:.1f}")
    report(say, rates, peaks, flops, num_tokens, linear_flops_per_token(engine.info.config))
    asked, dtype = dtype, str(engine.dtype).removeprefix("torch.")
    with tempfile.TemporaryDirectory(prefix="tokq-runtime-onnx-") as export_dir:
        onnx, why = onnx_encoder(Path(engine.info.path), export_dir, engine.info.max_length)
        say(f"\nforward time against batch tokens ({torch.get_num_threads()} threads; one query up to {ONE_QUERY_MAX} "
            f"tokens, else {PACKED_QUERY}-token queries packed; medians of {rounds} interleaved rounds of 5 forwards"
            f"{'' if onnx else f'; ONNX Runtime not run: {why}'}):\n")
        costed = {f"{dtype} (--dtype {asked})": engine, **{"float32": e for k, e in engines.items() if k == "fp32"}}
        say("\n".join(forward_costs(costed, onnx, [n for n in FORWARD_SIZES if n <= max(token_budgets)], rounds)))
    say(f"\nlinear layers alone ({dtype}, {engine.linear_backend}, same kernels and shapes, 1,024 tokens): "
        f"{statistics.median(v for vs in limits.values() for v in vs):,.0f} tokens/s median")
    say(f"the same linear layers with the epilogues the forward fuses into them ({fused_epilogues(engine)}): "
        f"{100 * statistics.median(epilogue_shares):.0f}% of that limit, the most the forward can reach even if "
        "nothing else took any time")
    say(f"\n| system | % of the {dtype} linear-layer limit (same kernels, same run) |\n|---|---:|")
    for name, rate in rates.items():
        if name.startswith("packed"):
            say(f"| {name} | {100 * statistics.median(r / lim for r, lim in zip(rate, limits[name])):.0f}% |")
    parts = {part: statistics.median(split[part] for split in splits) for part in splits[0]}
    say("\nwhere the packed 1024 forward's time goes, in units of its linear layers' time at the limit (1.00; each "
        "part timed in the forward, medians over rounds): " + ", ".join(f"{p} {s:.2f}" for p, s in parts.items())
        + f"; in all {sum(parts.values()):.2f}, i.e. {100 / sum(parts.values()):.0f}% of the limit")
    say(f"\nthe same by op ({dtype}, torch profiler, self CPU time):\n")
    say(op_table(engine, backend_batches))
    attn_ms = {b: attention_ms_per_layer(engine, backend_batches, b) for b in CPU_BACKENDS
               if attention.unavailable_reason(b, engine.device, engine.dtype) is None}
    if "cpu_varlen" in attn_ms:
        native_dp = engine.dtype == torch.bfloat16 and cpu_attention.bf16_dot_products(engine.model.head_dim)
        # the bf16 dot-product path is built at 16 floats only: narrower builds take fp32 math
        path = " (fp32-math path)" if native_dp else ""
        widths = {f"cpu_varlen at {lanes} floats a vector{path}": (f"-DLANES={lanes}",)
                  for lanes in VECTOR_WIDTHS if lanes != cpu_build.vector_lanes("cpu_attention")}
        if native_dp:
            widths["cpu_varlen without bf16 dot products"] = cpu_attention.WITHOUT_DOT_PRODUCTS
        for label, flags in widths.items():
            def variant(q, k, v, layout, causal, scale, flags=flags):
                return cpu_attention.attend(q, k, v, layout.cu_seqlens, causal, scale, extra_flags=flags)
            attn_ms[label] = attention_ms_per_layer(engine, backend_batches, "cpu_varlen", attend=variant)
    if engine.dtype != torch.float32:
        with sdpa_kernel_only():
            attn_ms["sdpa_packed, SDPA kernel only"] = attention_ms_per_layer(engine, backend_batches, "sdpa_packed")
    say("\nattention alone, ms per layer per 1,024-token batch: "
        + ", ".join(f"{backend} {ms:.2f}" for backend, ms in attn_ms.items()))


def report(say, rates: dict, peaks: dict, flops: dict, num_tokens: int, per_token: float) -> None:
    median = lambda values: statistics.median(list(values))  # noqa: E731

    def share(name: str, which: int, flops_per_token: float) -> str:
        values = [r * flops_per_token / p[which] for r, p in zip(rates[name], peaks[name]) if p[which]]
        return f"{100 * median(values):.0f}%" if values else "n/a"

    one, batched = rates["st one at a time"], rates[f"st batch {ST_BATCH}"]
    for which, label in ((0, "torch.mm (MKL)"), (1, "oneDNN linear")):
        if values := [p[which] for per_system in peaks.values() for p in per_system if p[which]]:
            say(f"fp32 peak, {label}: {median(values) / 1e9:.0f} GFLOP/s median (min {min(values) / 1e9:.0f}, max "
                f"{max(values) / 1e9:.0f}); linear-layer limit {median(values) / per_token:,.0f} tokens/s at "
                f"{per_token / 1e6:.1f} MFLOP/token")
    say("\n| system | tokens/s | x one-at-a-time | x batch-32 | % linear limit, fp32 mm peak | % linear limit, fp32 "
        "oneDNN peak | MFU, fp32 oneDNN peak |\n|---|---:|---:|---:|---:|---:|---:|")
    for name, rate in rates.items():
        mfu = share(name, 1, flops[name] / num_tokens) if name in flops else ""
        say(f"| {name} | {median(rate):,.0f} | {median(r / o for r, o in zip(rate, one)):.2f} | "
            f"{median(r / b for r, b in zip(rate, batched)):.2f} | {share(name, 0, per_token)} | "
            f"{share(name, 1, per_token)} | {mfu} |")


@click.command("runtime")
@click.option("--num-queries", default=800, show_default=True, help="Queries each system encodes per round.")
@click.option("--rounds", default=3, show_default=True)
@click.option("--token-budgets", default=",".join(map(str, BUDGETS)), show_default=True,
              help="Token budgets of the packed runtime, comma-separated.")
@click.option("--workload", type=click.Path(exists=True, dir_okay=False), default=None,
              help="JSONL workload [default: ../shared/workloads/short_queries.jsonl, else generated].")
@click.option("--model", default=None, help="Model directory [default: bundled all-MiniLM-L6-v2].")
@click.option("--threads", default=0, show_default=True, help="torch intra-op threads (0: torch's default).")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True,
              help="The runtime's dtype (auto: bf16 on CPUs with native bf16, else fp32).")
@click.option("--results-md", type=click.Path(dir_okay=False), default=None,
              help="Rewrite this file's section (profiling/results/model.md) with the output.")
def runtime_command(num_queries, rounds, token_budgets, workload, model, threads, dtype, results_md) -> None:
    """Packed (varlen) runtime vs sentence-transformers on the short-query workload."""
    from tokq.host import vector_extension

    if threads:
        torch.set_num_threads(threads)
    out: list[str] = []

    def say(text: str) -> None:
        click.echo(text)
        out.append(text)
    measure(say, num_queries=num_queries, rounds=rounds, token_budgets=[int(b) for b in token_budgets.split(",")],
            workload=workload, model=model, dtype=dtype)
    if results_md:
        name = block_name(dtype)
        write_block(results_md, name, block(name, generated_by="tokq bench runtime", lines=[
            f"## Model runtime, `--dtype {dtype}`, {vector_extension()} CPU: packed forward vs sentence-transformers "
            "and its own linear-layer limit", "",
            f"Command: `{command_line()}` ({machine_cores()}: absolute figures move with other work; each system is "
            "timed right after its own limit and peak measurements).", "", "```", "\n".join(out).rstrip(), "```"]))
