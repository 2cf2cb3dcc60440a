"""A rerank request from the gateway's rerank path through a real Redis queue to the worker's own
batch code, in one process: one queue item per (query, document) pair counted by its own tokens
(so a request's pairs spread over claims), segment ids and the shared prefix carried to the worker,
results equal to CrossEncoder.rank, and every bad input refused with nothing left in Redis."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import redis
from tiny_rerankers import (DOCUMENTS, LONG_DOCUMENT, QUERY, build_bert_cross_encoder,
                            build_qwen3_causal_reranker, build_qwen3_seq_cls)

from tokq.config import GatewayConfig, QueueConfig, WorkerConfig
from tokq.gateway.embedding import ServedModel, Timer
from tokq.gateway.errors import InvalidArgument
from tokq.gateway.prompt_boundary import shared_prompt_len
from tokq.gateway.rerank import RerankInput, rerank
from tokq.gateway.replies import ReplyRouter
from tokq.gateway.tokenize import Tokenizer
from tokq.gateway.validate import InputTooLarge
from tokq.model.info import ModelInfo
from tokq.queue.sharded import ShardedQueue
from tokq.queue.wire import decode_body
from tokq.redis.connection import connect, connect_pubsub
from tokq.workers.engine import Engine
from tokq.workers.worker import Worker


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("rerank_e2e")
    return {"bert": build_bert_cross_encoder(root / "bert"),
            "qwen3_causal": build_qwen3_causal_reranker(root / "causal"),
            "qwen3_seq_cls": build_qwen3_seq_cls(root / "seq_cls")}


@pytest.fixture(scope="module")
def stacks(folders):
    """(info, tokenizer, engine) per reranker, loaded once."""
    out = {}
    for kind, path in folders.items():
        info = ModelInfo.load(path)
        out[kind] = (info, Tokenizer(info), Engine.load(path, device="cpu", dtype="float32"))
    yield out
    for _, tok, _ in out.values():
        tok.close()


async def _serve(redis_url, info, tokenizer, engines, request, *, budget=4096, config=None):
    """The gateway's rerank call, answered by workers (one per engine, claiming in turn with
    ``budget``); returns (the output or the exception, the claims)."""
    client, pubsub = connect(redis_url), connect_pubsub(redis_url)
    queue = ShardedQueue(client, info.queue_name, QueueConfig())
    router = ReplyRouter(pubsub, client, queue.producer.reply_key, [k.notice_channel("gw-r") for k in queue.shard_keys()])
    await router.start()
    claims = []
    try:
        served = ServedModel(info, tokenizer, queue, router, config or GatewayConfig(), "gw-r")
        workers = [Worker(e, queue, WorkerConfig(token_budget=budget), QueueConfig(), worker_id=f"w{i}")
                   for i, e in enumerate(engines)]
        call = asyncio.create_task(rerank(served, request, Timer(60)))
        turn = 0
        while not call.done():
            claim = await queue.consumer.claim(budget)
            if claim is None:
                await asyncio.sleep(0.01)
                continue
            claims.append(claim)
            outcome = await asyncio.to_thread(workers[turn % len(workers)].loop.run_batch, claim)
            turn += 1
            await queue.consumer.ack(claim.batch_id, outcome.results)
            await asyncio.sleep(0.01)
        return (call.exception() or call.result()), claims
    finally:
        await router.stop()
        await client.aclose()
        await pubsub.aclose()


def _rank(folder, docs, query=QUERY, **kwargs):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(folder), device="cpu").rank(query, docs, **kwargs)


@pytest.mark.parametrize("kind", ["bert", "qwen3_causal", "qwen3_seq_cls"])
def test_results_equal_cross_encoder_rank(redis_url, stacks, folders, kind):
    info, tok, engine = stacks[kind]
    docs = DOCUMENTS + [LONG_DOCUMENT]
    pairs = tok.encode_pairs_sync(QUERY, docs, truncate=True)
    computed_before = engine.tokens_computed
    out, claims = asyncio.run(_serve(redis_url, info, tok, [engine],
                                     RerankInput(QUERY, docs, truncate=True, return_documents=True)))
    want = _rank(folders[kind], docs)
    assert [i for i, _ in out.results] == [r["corpus_id"] for r in want]
    assert [s for _, s in out.results] == pytest.approx([r["score"] for r in want], abs=2e-5)
    assert out.num_tokens == sum(len(s) for s in pairs.ids) and out.model == info.name
    assert set(out.timing) == {"tokenize_ms", "queue_ms", "inference_ms", "total_ms"}
    # one item per pair, each counted by the tokens a worker computes for it
    entries = sorted((e for c in claims for e in c.entries), key=lambda e: e.index)
    bodies = [decode_body(e.body) for e in entries]
    assert [b.token_ids.tolist() for b in bodies] == pairs.ids
    assert [b.segment_start for b in bodies] == pairs.segment_starts
    if info.is_decoder:  # the rendered text before the document is computed once
        prompt_lens = [shared_prompt_len(s, pairs.prefix_ids) for s in pairs.ids]
        assert [b.prompt_len for b in bodies] == prompt_lens and min(prompt_lens) > 40
        assert [e.num_tokens for e in entries] == [len(s) - p for s, p in zip(pairs.ids, prompt_lens)]
        assert engine.tokens_computed - computed_before < out.num_tokens // 2
    else:  # bidirectional attention: every token depends on the document, nothing is shared
        assert [b.prompt_len for b in bodies] == [0] * len(docs)
        assert [e.num_tokens for e in entries] == [len(s) for s in pairs.ids]
        assert min(pairs.segment_starts) > 0


def test_the_query_is_computed_once_across_batches(redis_url, stacks, folders):
    """A causal reranker's request split over several claims: the rendered prefix (system turn,
    instruction, query) is computed by the first batch and taken from the prefix cache after."""
    info, tok, engine = stacks["qwen3_causal"]
    docs = [f"{d} number {i}" for i in range(3) for d in DOCUMENTS]
    pairs = tok.encode_pairs_sync(QUERY + " once", docs)
    prompt_lens = [shared_prompt_len(s, pairs.prefix_ids) for s in pairs.ids]
    own = sum(len(s) - p for s, p in zip(pairs.ids, prompt_lens))
    before = engine.tokens_computed
    out, claims = asyncio.run(_serve(redis_url, info, tok, [engine], RerankInput(QUERY + " once", docs),
                                     budget=own // 3))
    assert len(claims) >= 3
    assert sum(e.num_tokens for c in claims for e in c.entries) == own  # the claims count what is computed
    distinct = {tuple(s[:p]) for s, p in zip(pairs.ids, prompt_lens)}
    assert engine.tokens_computed - before == own + sum(len(d) for d in distinct)  # each prefix once
    want = _rank(folders["qwen3_causal"], docs, query=QUERY + " once")
    assert [i for i, _ in out.results] == [r["corpus_id"] for r in want]
    assert [s for _, s in out.results] == pytest.approx([r["score"] for r in want], abs=2e-5)


def test_top_n_raw_scores_and_documents(redis_url, stacks, folders):
    info, tok, engine = stacks["bert"]
    out, _ = asyncio.run(_serve(redis_url, info, tok, [engine],
                                RerankInput(QUERY, DOCUMENTS, top_n=3, raw_scores=True)))
    import torch

    want = _rank(folders["bert"], DOCUMENTS, top_k=3, activation_fn=torch.nn.Identity())
    assert [i for i, _ in out.results] == [r["corpus_id"] for r in want]
    assert [s for _, s in out.results] == pytest.approx([r["score"] for r in want], abs=1e-4)
    assert min(s for _, s in out.results) < 0 or max(s for _, s in out.results) > 1  # not a probability
    big, _ = asyncio.run(_serve(redis_url, info, tok, [engine], RerankInput(QUERY, DOCUMENTS, top_n=100)))
    assert len(big.results) == len(DOCUMENTS)


def test_one_requests_pairs_spread_over_workers(redis_url, stacks, folders):
    """Claims of a small budget take a few pairs each: two workers share one request."""
    info, tok, engine = stacks["bert"]
    other = Engine.load(folders["bert"], device="cpu", dtype="float32")
    docs = [f"{d} number {i}" for i in range(4) for d in DOCUMENTS]
    before = (engine.tokens_computed, other.tokens_computed)
    out, claims = asyncio.run(_serve(redis_url, info, tok, [engine, other], RerankInput(QUERY, docs), budget=60))
    assert len(claims) >= 4 and sum(len(c.entries) for c in claims) == len(docs)
    assert engine.tokens_computed > before[0] and other.tokens_computed > before[1]
    assert [i for i, _ in out.results] == [r["corpus_id"] for r in _rank(folders["bert"], docs)]


def _left_in_redis(redis_url) -> list:
    client = redis.Redis.from_url(redis_url)
    try:
        return [k for k in client.keys("*") if b"reply:" in k or b"pending" in k or b"heavy" in k]
    finally:
        client.close()


BAD = [
    (RerankInput("", DOCUMENTS), InvalidArgument, "query is empty"),
    (RerankInput(QUERY, []), InvalidArgument, "documents is empty"),
    (RerankInput(QUERY, ["fine", ""]), InvalidArgument, "document 1 is an empty string"),
    (RerankInput(QUERY, ["d"] * 9), InvalidArgument, "9 documents in one request; the limit is 8"),
    (RerankInput(QUERY, DOCUMENTS, top_n=0), InvalidArgument, "top_n must be an integer >= 1"),
    (RerankInput(QUERY, DOCUMENTS, top_n=2.5), InvalidArgument, "top_n must be an integer >= 1"),
    (RerankInput(QUERY, ["x" * 3000]), InputTooLarge, "document 0 is 3,000 bytes"),
    (RerankInput("q" * 3000, ["x"]), InputTooLarge, "the query is 3,000 bytes"),
    (RerankInput(QUERY, ["x" * 1500] * 4), InputTooLarge, "the query and documents are"),
    (RerankInput(QUERY, [LONG_DOCUMENT[:1000], LONG_DOCUMENT[:2000]]), InvalidArgument,
     "document 0 with the query is"),
]


@pytest.mark.parametrize("request_, error, message", BAD, ids=[m for _, _, m in BAD])
def test_bad_input_is_refused_with_nothing_queued(redis_url, stacks, request_, error, message):
    info, tok, engine = stacks["bert"]
    config = dataclasses.replace(GatewayConfig(), max_inputs=8, max_input_bytes=2048, max_request_bytes=5000)
    exc, claims = asyncio.run(_serve(redis_url, info, tok, [engine], request_, config=config))
    assert isinstance(exc, error) and message in str(exc), exc
    assert not claims and not _left_in_redis(redis_url)
    # the same service then serves a good request
    out, _ = asyncio.run(_serve(redis_url, info, tok, [engine], RerankInput(QUERY, DOCUMENTS), config=config))
    assert len(out.results) == len(DOCUMENTS)


def test_tasks_are_not_mixed(redis_url, stacks, bundled_model_dir):
    info, tok, engine = stacks["bert"]
    embedder = ModelInfo.load(bundled_model_dir)
    etok = Tokenizer(embedder)
    try:
        exc, _ = asyncio.run(_serve(redis_url, embedder, etok, [engine], RerankInput(QUERY, DOCUMENTS)))
    finally:
        etok.close()
    assert isinstance(exc, InvalidArgument) and "task: embed" in str(exc) and exc.param == "model"
    assert not _left_in_redis(redis_url)
