"""Rerank benchmark, four sections from one run: 100-candidate requests through the service against
CrossEncoder.predict on the same pairs; 200-candidate requests on one worker and on two, against a
1 s deadline; an Embed call beside a rerank burst; a causal reranker with its query computed once.

    tokq bench rerank --results-md profiling/results/rerank.md

Random weights, nothing downloaded: a BERT cross-encoder shaped like ms-marco-MiniLM-L6-v2 on the
bundled tokenizer, and a Qwen3 causal reranker with Qwen3-Reranker-0.6B's widths and template.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import click
import grpc
import numpy as np
import torch

from tokq.profiling import harness
from tokq.profiling.harness import pct
from tokq.profiling.results_md import block, command_line, machine_cores, publish, table
from tokq.testing.rerankers import QWEN3_RERANKER_TEMPLATE

BLOCK = "tokq bench rerank"
PARTS = ("service", "workers", "fairness", "causal")
EMBED = "minilm-embed"
BURST_CALLERS = 2  # each sends 100-candidate requests back to back
PACE_S = 0.02  # the Embed probe's sleep between calls
CROSS_ENCODER = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
QWEN3 = dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=3072)


def build_cross_encoder(path: Path) -> Path:
    import transformers

    from tokq.model.info import bundled_model_path

    tok = transformers.AutoTokenizer.from_pretrained(str(bundled_model_path()))
    tok.save_pretrained(path)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=tok.vocab_size, max_position_embeddings=512, num_labels=1, **CROSS_ENCODER))
    with torch.no_grad():  # far from the init's std 0.02, so scores differ between pairs
        for name, param in model.named_parameters():
            param.normal_(1.0 if "LayerNorm.weight" in name else 0.0, 0.1)
    model.save_pretrained(path)
    return path


def build_causal(path: Path, layers: int) -> Path:
    import transformers
    from sentence_transformers import CrossEncoder
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    words, rust = harness.vocab_words(lowercase=True), Tokenizer(models.BPE())
    rust.pre_tokenizer, rust.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    rust.train_from_iterator([QWEN3_RERANKER_TEMPLATE, "yes", "no", *(" ".join(words[i:i + 50]) for i in range(0, len(words), 50))],
                             trainers.BpeTrainer(vocab_size=32768, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                                 initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=rust, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                               model_max_length=512)
    tok.chat_template = QWEN3_RERANKER_TEMPLATE
    tok.save_pretrained(path / "plain")
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=len(tok), num_hidden_layers=layers, max_position_embeddings=1024, tie_word_embeddings=True,
        rope_theta=1_000_000.0, **QWEN3)).save_pretrained(path / "plain")
    CrossEncoder(str(path / "plain"), device="cpu").save(str(path / "saved"))
    return path / "saved"


def make_requests(n: int, candidates: int, words: tuple[int, int], seed: int) -> list[tuple[str, list[str]]]:
    vocab, rng = harness.vocab_words(lowercase=True), random.Random(seed)
    return [(" ".join(rng.choices(vocab, k=8)), [" ".join(rng.choices(vocab, k=rng.randint(*words)))
                                                  for _ in range(candidates)]) for _ in range(n)]


@contextlib.contextmanager
def fleet(folder: Path, threads: int, dtype: str, budget: int):
    """(gRPC target, pids by name): an embedded Redis, the gateway and every worker, warmed up."""
    import redis

    from tokq.model.info import ModelInfo, bundled_model_path
    from tokq.processes import stop_all, wait_for_health
    from tokq.queue.keys import QueueKeys
    from tokq.redis.embedded import EmbeddedRedis, free_port

    # the cross-encoder under three names, each its own queue: torch threads of each of its workers
    pools = {"ce-1x1": [1], f"ce-1x{threads}": [threads], "ce-2x1": [1, 1]}
    served = {EMBED: ([1], bundled_model_path()), **{n: (t, folder) for n, t in pools.items()}}
    server, procs, port = EmbeddedRedis().start(), {}, free_port()
    client, beats = redis.Redis.from_url(server.url), []
    try:
        for name, (counts, path) in served.items():
            for i, n in enumerate(counts):
                procs[f"{name}-{i}"] = harness.tokq(
                    "worker", "--model", str(path), "--served-model-name", name, "--worker-id", f"{name}-{i}",
                    "--threads", str(n), "--dtype", dtype, "--token-budget", str(budget), redis_url=server.url)
                beats.append(QueueKeys(ModelInfo.load(str(path), name=name).queue_name).heartbeat(f"{name}-{i}"))
        models = [a for name, (_, path) in served.items() for a in ("--model", str(path), "--served-model-name", name)]
        procs["gateway"] = harness.tokq("gateway", "--host", "127.0.0.1", "--port", str(port), *models,
                                        redis_url=server.url)
        harness.wait_until(lambda: all(client.exists(k) for k in beats), "worker heartbeats", procs.values(), 600)
        wait_for_health(f"127.0.0.1:{port}", [procs["gateway"]], 120)
        yield f"127.0.0.1:{port}", {**{k: p.pid for k, p in procs.items()}, "redis": server.pid, "bench": os.getpid()}
    finally:
        stop_all(procs.values(), timeout_s=30)
        client.close()
        server.close()


def reranker(target: str, model: str, raw: bool = False):
    from tokq.v1 import embedder_pb2 as pb
    from tokq.v1 import embedder_pb2_grpc as pb_grpc

    rpc = pb_grpc.EmbedderStub(grpc.insecure_channel(target, harness.GRPC_LIMITS))
    return lambda q, docs: rpc.Rerank(pb.RerankRequest(query=q, documents=docs, model=model, raw_scores=raw), timeout=300)


def run_rounds(systems: dict, rounds: int, pids: dict[str, int]) -> dict:
    """Each system's requests one after another, the systems back to back in each round, their
    order flipped every round: latencies (ms), pairs/s and cores used per round."""
    out = {name: {"lat": [], "rate": [], "cores": []} for name in systems}
    for call, reqs in systems.values():
        call(*reqs[0])  # warm-up
    for r in range(rounds):
        for name in list(systems)[::1 if r % 2 == 0 else -1]:
            call, reqs = systems[name]
            with harness.CpuWindow(pids) as cpu:
                for q, docs in reqs:
                    start = time.perf_counter()
                    call(q, docs)
                    out[name]["lat"].append(1000 * (time.perf_counter() - start))
            out[name]["rate"].append(sum(len(d) for _, d in reqs) / cpu.wall_s)
            out[name]["cores"].append(sum(cpu.cpu_s.values()) / cpu.wall_s)
        click.echo(f"round {r + 1}/{rounds}: " + ", ".join(f"{k} {v['rate'][-1]:.0f} pairs/s" for k, v in out.items()))
    return out


def ratio(num: list[float], den: list[float]) -> str:
    r = [a / b for a, b in zip(num, den)]
    return f"**{statistics.median(r):.2f}** ({min(r):.2f}-{max(r):.2f})"


def rows(res: dict, base: str) -> list[list]:
    return [[name, len(r["lat"]), f"{statistics.median(r['rate']):,.0f}",
             f"{statistics.median(r['lat']):,.0f} / {pct(r['lat'], 0.99):,.0f}",
             f"{sum(x <= 1000 for x in r['lat'])}/{len(r['lat'])}", f"{statistics.median(r['cores']):.2f}",
             ratio(r["rate"], res[base]["rate"])] for name, r in res.items()]


def _burst(target: str, reqs: list, stop, done) -> None:
    """One burst caller: 100-candidate requests to ce-1x1 back to back until ``stop``."""
    call = reranker(target, "ce-1x1")
    while not stop.is_set():
        call(*reqs[done.value % len(reqs)])
        with done.get_lock():
            done.value += 1


def fairness(target: str, pids: dict[str, int], reqs: list, rounds: int, phase_s: float) -> dict:
    """Single-query Embed latencies idle, then during a burst of rerank on ce-1x1, per round."""
    from tokq.v1 import embedder_pb2 as pb
    from tokq.v1 import embedder_pb2_grpc as pb_grpc

    rpc, ctx = pb_grpc.EmbedderStub(grpc.insecure_channel(target)), multiprocessing.get_context("spawn")
    out = {"idle": [], "burst": [], "cores": [], "machine": [], "reranks": 0, "queue": [], "inference": []}

    def probe(seconds: float, phase: str) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            start = time.perf_counter()
            t = rpc.Embed(pb.EmbedRequest(inputs=["red running shoes for long trail races"], model=EMBED), timeout=30).timing
            out[phase].append(1000 * (time.perf_counter() - start))
            if phase == "burst":  # where a slowed call's time went: waiting in the queue, or its forward
                out["queue"].append(t.queue_ms)
                out["inference"].append(t.inference_ms)
            time.sleep(PACE_S)
    probe(2.0, "idle")  # warm-up
    out["idle"].clear()
    for r in range(rounds):
        probe(phase_s, "idle")
        stop, done = ctx.Event(), ctx.Value("l", 0)
        callers = [ctx.Process(target=_burst, args=(target, reqs, stop, done), daemon=True) for _ in range(BURST_CALLERS)]
        for c in callers:
            c.start()
        harness.wait_until(lambda: done.value > 0, "a burst reply", timeout_s=300)  # under way, more queued
        with harness.CpuWindow({**pids, **{f"burst {i}": c.pid for i, c in enumerate(callers)}}) as cpu:
            probe(phase_s, "burst")
        out["cores"].append(cpu.cores())
        out["machine"].append(cpu.machine_cores or 0.0)
        stop.set()
        for c in callers:
            c.join(300)
        out["reranks"] += done.value
        click.echo(f"fairness round {r + 1}/{rounds}: Embed p99 idle {pct(out['idle'], 0.99):.1f} ms, "
                   f"burst {pct(out['burst'], 0.99):.1f} ms")
    return out


def causal(folder: Path, reqs: list, budget: int, rounds: int, dtype: str) -> tuple[list, dict]:
    """One 100-candidate request per round (a new query each) through a worker's engine three ways."""
    from tokq.gateway.prompt_boundary import shared_prompt_len
    from tokq.gateway.tokenize import Tokenizer
    from tokq.profiling.bench.prefix import batches, time_system
    from tokq.workers.engine import Engine

    once = Engine.load(folder, dtype=dtype)
    info, args = once.info, (once.info, once.model, once.device, once.dtype, once.attn_backend)
    full = Engine(*args, head=once.head)
    full.prompt_cache = None  # every pair computed whole: no shared-prompt path at all
    engines = {"each pair whole": (full, False), "query once per request (prefix cache)": (once, True),
               "query once per batch (--prompt-cache-mb 0)": (Engine(*args, prompt_cache_bytes=0, head=once.head), True)}
    tok = Tokenizer(info, threads=1)
    try:
        encoded = [tok.encode_pairs_sync(q, docs, prompt=info.prompt(None)) for q, docs in reqs]
    finally:
        tok.close()
    seqs = [[np.asarray(s) for s in p.ids] for p in encoded]
    lens = [[shared_prompt_len(s, p.prefix_ids) for s in p.ids] for p in encoded]
    packed = {k: [batches(s, n, budget, shared) for s, n in zip(seqs, lens)] for k, (_, shared) in engines.items()}
    computed, scores = {}, {}
    for k, (eng, _) in engines.items():  # the warm-up request, not timed
        before = eng.tokens_computed
        scores[k] = np.concatenate([eng.embed(b)[:, 0] for b in packed[k][0]])
        computed[k] = eng.tokens_computed - before
    times = {k: [] for k in engines}
    for r in range(rounds):
        for k in list(engines)[::1 if r % 2 == 0 else -1]:
            times[k].append(time_system(engines[k][0], packed[k][1 + r]))
        click.echo(f"causal round {r + 1}/{rounds}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()))
    base, n = times["each pair whole"], len(reqs[0][1])
    table_rows = [[k, len(packed[k][0]), f"{computed[k]:,}", f"{n / statistics.median(t):.1f}",
                   f"{1000 * statistics.median(t):,.0f}", f"{np.abs(scores[k] - scores['each pair whole']).max():.2g}",
                   ratio(base, t)] for k, t in times.items()]
    return table_rows, {"prefix": len(encoded[0].prefix_ids), "dtype": str(once.dtype).removeprefix("torch."),
                        "after": float(np.mean([len(s) - n for s, n in zip(seqs[0], lens[0])])),
                        "spread": float(np.ptp(scores["each pair whole"])), "attn": once.attn_backend}


def section(part: str, title: str, text: str, head: str, table_rows: list, reading: str = "") -> str:
    m = harness.machine()
    return block(f"{BLOCK} ({part})", [
        f"## {title}", "", f"Command: `{command_line()}`. {m['cpu']} ({m['vector_extension']}), {machine_cores()}; "
        f"load average {' / '.join(harness.loadavg())} at the end. {text}", "",
        *table(head, table_rows), *(["", reading] if reading else []), ""], generated_by=BLOCK)


def cross_encoder_parts(parts, folder, threads, dtype, budget, requests, rounds, phase_s) -> list[str]:
    from sentence_transformers import CrossEncoder

    how = (f"Workers: budget {budget} tokens, `--dtype {dtype}`. Requests go one at a time. pairs/s and cores: medians "
           "over rounds; ratios: the median (range) of per-round ratios, the systems back to back in each round, in an "
           "order flipped every round. Cores: CPU-seconds of the gateway, every worker, Redis and this process (the "
           "caller, and CrossEncoder) per wall second. Within 1 s: requests answered within a 1 s deadline.")
    out, head = [], "system | requests | pairs/s | latency p50 / p99 ms | within 1 s | cores | x "
    with fleet(folder, threads, dtype, budget) as (target, pids):
        if "service" in parts:
            reqs, (q, docs) = make_requests(requests, 100, (20, 60), 1), make_requests(1, 100, (20, 60), 0)[0]
            ces = {d: CrossEncoder(str(folder), device="cpu", model_kwargs={"dtype": getattr(torch, d)})
                   for d in ("float32", "bfloat16")}
            want = ces["float32"].predict([(q, d) for d in docs], activation_fn=torch.nn.Identity())
            diff = max(abs(r.score - want[r.index]) for r in reranker(target, f"ce-1x{threads}", True)(q, docs).results)
            res = run_rounds({f"tokq: gateway + 1 worker ({threads} threads)": (reranker(target, f"ce-1x{threads}"), reqs),
                              **{f"CrossEncoder.predict(batch_size=32), {d}": (lambda q, docs, ce=ce: ce.predict(
                                  [(q, d) for d in docs], batch_size=32), reqs) for d, ce in ces.items()}}, rounds, pids)
            tokq, _, st16 = res.values()
            out.append(section("service", "A cross-encoder through the service against CrossEncoder.predict",
                               f"{requests} requests of 100 candidates per system per round, {rounds} rounds, the same "
                               f"pairs for each. CrossEncoder: {threads} torch threads. {how} Raw scores against "
                               f"CrossEncoder fp32's: within {diff:.2g} (they span {np.ptp(want):.2g}).",
                               head + "CrossEncoder fp32", rows(res, list(res)[1]),
                               f"tokq's pairs/s against CrossEncoder bf16's: {ratio(tokq['rate'], st16['rate'])}."))
        if "workers" in parts:
            reqs = make_requests(requests, 200, (20, 60), 2)
            names = {"1 worker x 1 thread": "ce-1x1", f"1 worker x {threads} threads": f"ce-1x{threads}",
                     "2 workers x 1 thread": "ce-2x1"}
            res = run_rounds({k: (reranker(target, m), reqs) for k, m in names.items()}, rounds, pids)
            out.append(section("workers", "One request's candidates on one worker and on two",
                               f"{requests} requests of 200 candidates per system per round, {rounds} rounds. A request's "
                               f"pairs are queue items that any free worker of its model claims. {how} The gateway and "
                               f"Redis share the {os.cpu_count()} CPUs with the workers.",
                               head + "1 worker x 1 thread", rows(res, "1 worker x 1 thread"),
                               "A 200-candidate request answered within 1 s needs 200 pairs/s; the fastest fleet here "
                               f"served {max(statistics.median(r['rate']) for r in res.values()):,.0f}."))
        if "fairness" in parts:
            keep = {k: pids[k] for k in ("gateway", f"{EMBED}-0", "ce-1x1-0", "redis", "bench")}
            f = fairness(target, keep, make_requests(4, 100, (20, 60), 3), rounds, phase_s)
            cores = {k: statistics.median(c[k] for c in f["cores"]) for k in f["cores"][0]}
            idle, burst = f["idle"], f["burst"]
            out.append(section(
                "fairness", "An Embed call beside a burst of rerank requests",
                "One gateway serves the embedding model (all-MiniLM-L6-v2) and the cross-encoder, each with its own "
                f"queue and one-thread worker. A probe sends one 8-word Embed, then sleeps {PACE_S * 1000:.0f} ms: "
                f"{phase_s:.0f} s idle, then {phase_s:.0f} s while {BURST_CALLERS} callers (processes) send 100-candidate "
                f"rerank requests back to back ({f['reranks']} answered); {rounds} rounds, latencies pooled. Cores during "
                "the bursts (medians): " + ", ".join(f"{k} {v:.2f}" for k, v in cores.items()) + "; the whole machine "
                f"{statistics.median(f['machine']):.2f} of {os.cpu_count()}, other processes included. During the "
                f"bursts an Embed call's own timing gave p99 {pct(f['queue'], 0.99):.1f} ms waiting in its queue and "
                f"p99 {pct(f['inference'], 0.99):.1f} ms in its forward.",
                "Embed calls | idle p50 / p99 ms | burst p50 / p99 ms | p99 ratio (target <= 2)",
                [[f"{len(idle)} idle, {len(burst)} burst", f"{statistics.median(idle):.1f} / {pct(idle, 0.99):.1f}",
                  f"{statistics.median(burst):.1f} / {pct(burst, 0.99):.1f}", f"**{pct(burst, 0.99) / pct(idle, 0.99):.2f}**"]]))
    return out


@click.command("rerank")
@click.option("--requests", default=2, show_default=True, help="Requests per system per round.")
@click.option("--rounds", default=5, show_default=True)
@click.option("--threads", default=2, show_default=True, help="CrossEncoder's, the causal engine's and one worker's.")
@click.option("--dtype", default="auto", show_default=True, help="The workers' and the causal engine's.")
@click.option("--token-budget", default=1024, show_default=True, help="Every worker's, and the causal batches'.")
@click.option("--causal-layers", default=4, show_default=True, help="Of Qwen3-Reranker-0.6B's 28.")
@click.option("--phase-s", default=10.0, show_default=True, help="Each idle and burst phase of the fairness part.")
@click.option("--parts", default=",".join(PARTS), show_default=True)
@click.option("--results-md", type=click.Path(dir_okay=False), default=None,
              help="Rewrite this file's sections (profiling/results/rerank.md).")
def rerank_command(requests, rounds, threads, dtype, token_budget, causal_layers, phase_s, parts, results_md) -> None:
    """A cross-encoder through tokq against CrossEncoder.predict, one and two workers, an Embed call
    beside a rerank burst, and a causal reranker's query computed once."""
    parts = [p for p in parts.split(",") if p]
    if set(parts) - set(PARTS):
        raise click.BadParameter(f"choose among {', '.join(PARTS)}", param_hint="--parts")
    torch.set_num_threads(threads)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        if set(parts) - {"causal"}:
            folder = build_cross_encoder(Path(tmp) / "ms-marco-MiniLM-L6-shaped")
            out += cross_encoder_parts(parts, folder, threads, dtype, token_budget, requests, rounds, phase_s)
        if "causal" in parts:
            folder = build_causal(Path(tmp) / "qwen3-reranker-shaped", causal_layers)
            table_rows, c = causal(folder, make_requests(rounds + 1, 100, (22, 30), 4), token_budget, rounds, dtype)
            out.append(section(
                "causal", "A causal reranker: the query computed once",
                f"Qwen3-Reranker-0.6B's widths (hidden 1024, 16 q / 8 kv heads of 128, MLP 3072), {causal_layers} of its "
                "28 layers (each path's time scales with layers alike; 28 take minutes a request here), random weights, "
                f"{c['dtype']}, attention {c['attn']}, {threads} threads: a worker's engine in this process, on the "
                f"gateway's token ids. One 100-candidate request per round, a new query each, {rounds} rounds, after a "
                f"warm-up request. The rendered prefix (system turn, instruction, query) is {c['prefix']} tokens; each "
                f"candidate adds {c['after']:.0f}. Batches of at most {token_budget} queued tokens, counted as the queue "
                "counts them (without the shared prefix). Tokens computed and score differences (raw scores spanning "
                f"{c['spread']:.2g}): on the warm-up request. A worker computes the query once per request; with "
                "`--prompt-cache-mb 0`, once per batch. No setting computes each pair whole.",
                "system | batches | tokens computed | pairs/s | ms per request | max score difference | x each pair whole",
                table_rows))
    for s in out:
        publish(s, results_md, s.split(": start", 1)[0].removeprefix("<!-- "))
