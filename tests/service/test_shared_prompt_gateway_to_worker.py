"""A prompt applied by the gateway reaches the worker as a shared prefix (issue 15), end to end
in one process with real parts: a tiny random Qwen3 with a real byte-level BPE tokenizer and
Qwen3-Embedding's prompts, the gateway's ServedModel, a real Redis queue and the worker's own
batch code. The queue counts only the query tokens, the worker computes the prompt once, and
every vector equals the full forward's, including prompts that end mid-word."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from prompted_model import INSTRUCT, PROMPTS, TEXTS, build_prompted_qwen3

from tokq.batch import PackedBatch
from tokq.config import GatewayConfig, QueueConfig, WorkerConfig
from tokq.redis.connection import connect, connect_pubsub
from tokq.queue.wire import decode_body, encode_body
from tokq.gateway.embedding import EmbedInput, ServedModel, Timer
from tokq.gateway.prompt_boundary import PromptBoundary, shared_prompt_len
from tokq.gateway.replies import ReplyRouter
from tokq.gateway.tokenize import Tokenizer
from tokq.model.info import ModelInfo
from tokq.queue.sharded import ShardedQueue
from tokq.workers.engine import Engine
from tokq.workers.worker import Worker


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_prompted")
    build_prompted_qwen3(path)
    return path


@pytest.fixture(scope="module")
def info(model_dir):
    return ModelInfo.load(model_dir)


def _prompt_ids(tokenizer, prompt):
    return tokenizer.encode_sync([""], prompt=prompt)[0]


def test_prompt_boundary_per_prompt_form(info, tokenizer):
    boundary = PromptBoundary(info, tokenizer)
    assert boundary.enabled
    full = {name: tokenizer.encode_sync(TEXTS, prompt=p) for name, p in PROMPTS.items()}
    eos = full["document"][0][-1]
    clean = _prompt_ids(tokenizer, INSTRUCT)[:-1]  # the prompt's tokens, without the closing <|endoftext|>
    # a clean boundary: every input starts with the prompt's own tokens, and shares all of them
    assert all(seq[:len(clean)] == clean for seq in full["query"])
    assert boundary.prompt_lens(INSTRUCT, full["query"]) == [len(clean)] * len(TEXTS)
    # a prompt ending in a space or mid-word: inputs whose first word merges with that end
    # ("Query: passages" -> "Query", ":", " passages"; "summ" + "arize" -> "summarize") do not
    # start with the prompt's tokens and share all but its last piece(s); the others share it all
    for name in ("spaced", "midword"):
        prompt_ids = _prompt_ids(tokenizer, PROMPTS[name])[:-1]
        lens = boundary.prompt_lens(PROMPTS[name], full[name])
        starts = [seq[:len(prompt_ids)] == prompt_ids for seq in full[name]]
        assert True in starts and False in starts, name  # both kinds in one request
        for seq, n, start in zip(full[name], lens, starts):
            assert n == len(prompt_ids) if start else 0 < n < len(prompt_ids)
            assert seq[:n] == prompt_ids[:n] and n < len(seq)
    # no prompt, or only special tokens in common: the full path
    assert boundary.prompt_lens("", full["document"]) == [0] * len(TEXTS)
    assert shared_prompt_len([eos], [eos, 5]) == 0  # a prefix always leaves a token


def test_encoders_never_mark_a_prefix(bundled_model_dir):
    bert = ModelInfo.load(bundled_model_dir)
    bert = ModelInfo(**{**bert.__dict__, "prompts": {"q": "query: "}})
    tok = Tokenizer(bert)
    try:
        boundary = PromptBoundary(bert, tok)
        assert not boundary.enabled
        assert boundary.prompt_lens("query: ", tok.encode_sync(["hi"], prompt="query: ")) == [0]
    finally:
        tok.close()


def test_entry_body_carries_the_prompt_length_compatibly():
    ids = np.arange(100, 130)
    body = decode_body(encode_body(ids, normalize=False, dimensions=8, prompt_len=20))
    assert (body.token_ids.tolist(), body.normalize, body.dimensions, body.prompt_len) == (
        ids.tolist(), False, 8, 20)
    plain = encode_body(ids)
    assert decode_body(plain).prompt_len == 0 and len(plain) == 4 + 2 * 30  # unchanged format
    with pytest.raises(ValueError, match="at least one"):
        encode_body(ids, prompt_len=30)


async def _serve_one_batch(redis_url, info, tokenizer, engine, request: EmbedInput):
    """The gateway enqueues the request; the worker's batch code answers it in one claim."""
    client, pubsub = connect(redis_url), connect_pubsub(redis_url)
    queue = ShardedQueue(client, info.queue_name, QueueConfig())
    router = ReplyRouter(pubsub, client, queue.producer.reply_key,
                         [k.notice_channel("gw-prefix") for k in queue.shard_keys()])
    await router.start()
    try:
        served = ServedModel(info, tokenizer, queue, router, GatewayConfig(), "gw-prefix")
        worker = Worker(engine, queue, WorkerConfig(token_budget=4096), QueueConfig(), worker_id="w")
        call = asyncio.create_task(served.embed(request, Timer(60)))
        claim = None
        while claim is None:
            assert not call.done(), call.exception()
            claim = await queue.consumer.claim(4096)
            await asyncio.sleep(0.01)
        outcome = await asyncio.to_thread(worker.loop.run_batch, claim)
        await queue.consumer.ack(claim.batch_id, outcome.results)
        return await call, claim
    finally:
        await router.stop()
        await client.aclose()
        await pubsub.aclose()


@pytest.mark.parametrize("prompt_name", ["query", "spaced", "midword", "document"])
def test_gateway_to_worker_computes_the_prompt_once_and_matches_the_full_forward(
        redis_url, info, tokenizer, model_dir, prompt_name):
    engine = Engine.load(model_dir, device="cpu", dtype="float32")
    prompt = PROMPTS[prompt_name]
    full_ids = tokenizer.encode_sync(TEXTS, prompt=prompt)
    prompt_lens = PromptBoundary(info, tokenizer).prompt_lens(prompt, full_ids)
    request = EmbedInput(texts=TEXTS, prompt_name=prompt_name, normalize=False)
    out, claim = asyncio.run(_serve_one_batch(redis_url, info, tokenizer, engine, request))

    # the queue counted the tokens the worker computes: each input's own, past its prefix
    assert sorted(e.num_tokens for e in claim.entries) == sorted(
        len(s) - p for s, p in zip(full_ids, prompt_lens))
    assert out.num_tokens == sum(len(s) for s in full_ids)  # usage still counts every token
    distinct = {tuple(s[:p]) for s, p in zip(full_ids, prompt_lens) if p}
    assert engine.tokens_computed == sum(len(s) - p for s, p in zip(full_ids, prompt_lens)) + sum(
        len(d) for d in distinct)
    if prompt_name != "document":
        assert distinct and engine.tokens_computed < sum(len(s) for s in full_ids)

    reference = Engine.load(model_dir, device="cpu", dtype="float32").embed(PackedBatch.pack(full_ids, normalize=False))
    ours = np.stack(out.vectors)
    cos = (ours * reference).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(reference, axis=1))
    assert cos.min() >= 0.9999
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=1e-4)
