"""Rerank over gRPC on a real deployment (its own Redis, a gateway process and a worker process
serving a tiny BERT cross-encoder): tokq.Client and AsyncClient results equal CrossEncoder.rank,
Info names the task, Embed on a reranker is refused by name, every bad input is INVALID_ARGUMENT
with nothing left in Redis while the service keeps serving, and `tokq rerank` prints JSON."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from service_stack import delivered_reply, embed_counts, gateway_and_worker
from tiny_rerankers import DOCUMENTS, LONG_DOCUMENT, QUERY, build_bert_cross_encoder

from tokq import AsyncClient, Client, TokqError
from tokq.redis.embedded import free_port

pytestmark = pytest.mark.slow

METRICS_PORT = free_port()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_bert_cross_encoder(tmp_path_factory.mktemp("rerank_service") / "bert-reranker")


@pytest.fixture(scope="module")
def stack(folder):
    with gateway_and_worker("--max-inputs", "16", "--metrics-port", str(METRICS_PORT), model=str(folder)) as s:
        yield s


@pytest.fixture(scope="module")
def reference(folder):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(folder), device="cpu")


def test_client_rerank_equals_cross_encoder_rank(stack, reference):
    want = reference.rank(QUERY, DOCUMENTS, return_documents=True)
    with Client(stack.target) as client:
        got = client.rerank(QUERY, DOCUMENTS, return_documents=True)
        assert [r.index for r in got] == [w["corpus_id"] for w in want]
        assert [r.score for r in got] == pytest.approx([w["score"] for w in want], abs=2e-5)
        assert [r.document for r in got] == [w["text"] for w in want]
        top = client.rerank(QUERY, DOCUMENTS, top_n=2)
        assert [r.index for r in top] == [w["corpus_id"] for w in want[:2]] and top[0].document is None
        full = client.rerank_full(QUERY, DOCUMENTS, raw_scores=True)
        raw = reference.predict([(QUERY, d) for d in DOCUMENTS], activation_fn=lambda x: x)
        assert {r.index: r.score for r in full.results} == pytest.approx(dict(enumerate(raw)), abs=1e-4)
        assert full.model == "bert-reranker" and full.prompt_tokens > 0 and full.timing["total_ms"] > 0

    async def run():
        async with AsyncClient(stack.target) as aclient:
            return await aclient.rerank(QUERY, DOCUMENTS, top_n=3)
    got = asyncio.run(run())
    assert [r.index for r in got] == [w["corpus_id"] for w in want[:3]]


def test_info_names_each_models_task(stack):
    with Client(stack.target) as client:
        info = client.info()
    assert (info.model, info.task, dict(info.tasks)) == ("bert-reranker", "rerank", {"bert-reranker": "rerank"})


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(TokqError) as err:
        call()
    return err.value.code, err.value.message


def test_bad_input_is_invalid_argument_and_the_service_keeps_serving(stack):
    with Client(stack.target) as client:
        cases = {
            "task: rerank": lambda: client.embed(["a reranker cannot embed"]),
            "query is empty": lambda: client.rerank("", DOCUMENTS),
            "documents is empty": lambda: client.rerank(QUERY, []),
            "document 2 is an empty string": lambda: client.rerank(QUERY, ["a", "b", ""]),
            "17 documents in one request; the limit is 16": lambda: client.rerank(QUERY, ["d"] * 17),
            "top_n must be an integer >= 1": lambda: client.rerank(QUERY, DOCUMENTS, top_n=0),
            "document 1 with the query is": lambda: client.rerank(QUERY, ["short", LONG_DOCUMENT]),
            "document 0 is 40,000 bytes": lambda: client.rerank(QUERY, ["x" * 40_000]),
        }
        for fragment, call in cases.items():
            code, message = _code(call)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and fragment in message, (fragment, message)
        with Client(stack.target, model="nope") as other:
            code, message = _code(lambda: other.rerank(QUERY, DOCUMENTS))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "unknown model 'nope'" in message
        with pytest.raises(TypeError, match="top_n must be an integer"):
            client.rerank(QUERY, DOCUMENTS, top_n=1.5)
        with pytest.raises(TypeError, match="list of strings"):
            client.rerank(QUERY, "one document")
        assert len(client.rerank(QUERY, DOCUMENTS, truncate=True)) == len(DOCUMENTS)
        assert len(client.rerank(QUERY, ["short", LONG_DOCUMENT], truncate=True)) == 2
    r = stack.client()
    try:  # nothing queued; the only replies left are answered ones in their short grace
        queued = [k for k in r.keys("*") if k.endswith((b"pending", b"heavy")) and r.llen(k)]
        assert not queued and all(delivered_reply(r, k) for k in r.keys("*") if b":reply:" in k)
    finally:
        r.close()


def test_tokq_rerank_prints_json_best_first(stack, reference):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "tokq.cli", "rerank", "--target", stack.target, *args],
                              capture_output=True, text=True, timeout=120)
    done = run("--top-n", "2", "--return-documents", QUERY, *DOCUMENTS)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    want = reference.rank(QUERY, DOCUMENTS, top_k=2)
    assert [r["index"] for r in out["results"]] == [w["corpus_id"] for w in want]
    assert out["results"][0]["document"] == DOCUMENTS[want[0]["corpus_id"]]
    assert out["model"] == "bert-reranker" and out["usage"]["prompt_tokens"] > 0
    failed = run(QUERY, "")
    assert failed.returncode == 1
    assert json.loads(failed.stderr)["error"]["code"] == "INVALID_ARGUMENT"


def test_metrics_carry_the_task(stack):
    import urllib.request

    with Client(stack.target) as client:
        client.rerank(QUERY, DOCUMENTS)
    assert embed_counts([METRICS_PORT], rpc="Rerank")[0] >= 1  # OK Rerank calls, by rpc
    text = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=5).read().decode()
    info = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "tokq_gateway_model_info"]
    assert [(s.labels, s.value) for s in info] == [({"model": "bert-reranker", "task": "rerank"}, 1.0)]
