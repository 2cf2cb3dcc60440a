"""Rerank over HTTP on a real deployment (a gateway with its HTTP port and a worker serving a tiny
BERT cross-encoder), in the shapes clients already speak: the real cohere SDK (ClientV2 on
/v2/rerank, Client on /v1/rerank), Jina's body (document objects) and TEI's /rerank with plain
httpx. Results equal CrossEncoder.rank; bad input is 400, 404 or 413 and the service keeps serving."""

from __future__ import annotations

import httpx
import pytest
from service_stack import gateway_and_worker
from tiny_rerankers import DOCUMENTS, LONG_DOCUMENT, QUERY, build_bert_cross_encoder

pytestmark = pytest.mark.slow

MODEL = "bert-reranker"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_bert_cross_encoder(tmp_path_factory.mktemp("rerank_http") / MODEL)


@pytest.fixture(scope="module")
def stack(folder):
    with gateway_and_worker("--max-inputs", "16", model=str(folder), http=True) as s:
        yield s


@pytest.fixture(scope="module")
def reference(folder):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(folder), device="cpu")


def test_cohere_sdk_v2_and_v1(stack, reference):
    import cohere

    want = reference.rank(QUERY, DOCUMENTS, return_documents=True)
    v2 = cohere.ClientV2(base_url=stack.http_url, api_key="unused")
    got = v2.rerank(model=MODEL, query=QUERY, documents=DOCUMENTS, top_n=3)
    assert [r.index for r in got.results] == [w["corpus_id"] for w in want[:3]]
    assert [r.relevance_score for r in got.results] == pytest.approx([w["score"] for w in want[:3]], abs=2e-5)
    assert got.id and got.meta.api_version.version == "2" and got.meta.billed_units.input_tokens > 0
    v1 = cohere.Client(base_url=stack.http_url, api_key="unused")
    old = v1.rerank(model=MODEL, query=QUERY, documents=DOCUMENTS, return_documents=True)
    assert [r.index for r in old.results] == [w["corpus_id"] for w in want]
    assert [r.document.text for r in old.results] == [w["text"] for w in want]
    with pytest.raises(cohere.errors.BadRequestError) as err:  # the SDK's own error for a 400
        v2.rerank(model=MODEL, query="", documents=DOCUMENTS)
    assert "query is empty" in str(err.value.body)


def test_jina_shape_with_document_objects(stack, reference):
    body = {"model": MODEL, "query": QUERY, "documents": [{"text": d} for d in DOCUMENTS],
            "top_n": 2, "return_documents": True}
    reply = httpx.post(f"{stack.http_url}/v1/rerank", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    out = reply.json()
    want = reference.rank(QUERY, DOCUMENTS, top_k=2)
    assert [r["index"] for r in out["results"]] == [w["corpus_id"] for w in want]
    assert out["results"][0]["document"] == {"text": DOCUMENTS[want[0]["corpus_id"]]}
    assert out["model"] == MODEL and out["usage"]["total_tokens"] > 0
    # a long document is cut, as Cohere cuts long documents (truncate defaults to true here)
    long = httpx.post(f"{stack.http_url}/v2/rerank", json={"model": MODEL, "query": QUERY,
                                                          "documents": ["short", LONG_DOCUMENT]}, timeout=60)
    assert long.status_code == 200 and len(long.json()["results"]) == 2


def test_tei_rerank(stack, reference):
    reply = httpx.post(f"{stack.http_url}/rerank", json={"query": QUERY, "texts": DOCUMENTS,
                                                         "raw_scores": True, "return_text": True}, timeout=60)
    assert reply.status_code == 200, reply.text
    out = reply.json()
    raw = reference.predict([(QUERY, d) for d in DOCUMENTS], activation_fn=lambda x: x)
    assert [r["index"] for r in out] == sorted(range(len(DOCUMENTS)), key=lambda i: -raw[i])
    assert [r["score"] for r in out] == pytest.approx([raw[r["index"]] for r in out], abs=1e-4)
    assert all(r["text"] == DOCUMENTS[r["index"]] for r in out)
    plain = httpx.post(f"{stack.http_url}/rerank", json={"query": QUERY, "texts": DOCUMENTS}, timeout=60).json()
    assert set(plain[0]) == {"index", "score"} and 0 < plain[0]["score"] < 1  # after the sigmoid
    # TEI's default: a too-long pair is refused, naming the document
    long = httpx.post(f"{stack.http_url}/rerank", json={"query": QUERY, "texts": ["a", LONG_DOCUMENT]}, timeout=60)
    assert long.status_code == 400 and "document 1 with the query is" in long.json()["error"]["message"]


BAD = [
    ("/v2/rerank", {"model": MODEL, "query": "", "documents": DOCUMENTS}, 400, "query is empty"),
    ("/v2/rerank", {"model": MODEL, "query": QUERY, "documents": []}, 400, "documents is empty"),
    ("/v2/rerank", {"model": MODEL, "query": QUERY, "documents": ["a", ""]}, 400, "document 1 is an empty string"),
    ("/v2/rerank", {"model": MODEL, "query": QUERY, "documents": ["d"] * 17}, 400, "17 documents"),
    ("/v2/rerank", {"model": MODEL, "query": QUERY, "documents": DOCUMENTS, "top_n": 0}, 400, "top_n must be"),
    ("/v2/rerank", {"model": MODEL, "query": QUERY, "documents": DOCUMENTS, "top_n": "2"}, 400, "top_n must be"),
    ("/v2/rerank", {"model": MODEL, "query": QUERY, "documents": DOCUMENTS, "top_n": 1.5}, 400, "top_n must be"),
    ("/v2/rerank", {"model": "nope", "query": QUERY, "documents": DOCUMENTS}, 404, "unknown model 'nope'"),
    ("/v2/rerank", {"model": MODEL, "query": QUERY, "documents": ["x" * 40_000]}, 413, "document 0 is 40,000 bytes"),
    ("/v2/rerank", {"model": MODEL, "query": QUERY, "documents": DOCUMENTS, "max_tokens_per_doc": 8}, 400,
     "max_tokens_per_doc is not supported"),
    ("/v2/rerank", {"model": MODEL, "query": QUERY, "documents": [3]}, 400, "documents item 0 must be"),
    ("/v2/rerank", {"model": MODEL, "query": QUERY, "docs": DOCUMENTS}, 400, "unknown field(s) docs"),
    ("/rerank", {"query": QUERY, "texts": [{"text": "objects are Cohere's"}]}, 400, "texts item 0 must be a string"),
    ("/rerank", {"query": QUERY}, 400, "texts is required"),
    ("/v1/embeddings", {"model": MODEL, "input": ["a reranker cannot embed"]}, 400, "task: rerank"),
]


@pytest.mark.parametrize("path, body, status, message", BAD, ids=[b[3] for b in BAD])
def test_bad_input(stack, path, body, status, message):
    reply = httpx.post(f"{stack.http_url}{path}", json=body, timeout=60)
    assert reply.status_code == status, reply.text
    assert message in reply.json()["error"]["message"]
    ok = httpx.post(f"{stack.http_url}/rerank", json={"query": QUERY, "texts": DOCUMENTS}, timeout=60)
    assert ok.status_code == 200
