"""LangChain's and LlamaIndex's Cohere rerankers (langchain-cohere's CohereRerank, LlamaIndex's
cohere_rerank postprocessor) pointed at a real deployment's Cohere-shaped /v2/rerank by base_url:
their order and scores equal CrossEncoder.rank's. Both packages are in the test extra, which pins
cohere to 5.x, the range langchain-cohere allows; a missing package fails its test, not skips it."""

from __future__ import annotations

import pytest
from service_stack import gateway_and_worker
from tiny_rerankers import DOCUMENTS, QUERY, build_bert_cross_encoder

pytestmark = pytest.mark.slow  # starts a gateway and worker

MODEL = "bert-reranker"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_bert_cross_encoder(tmp_path_factory.mktemp("rerank_frameworks") / MODEL)


@pytest.fixture(scope="module")
def stack(folder):
    with gateway_and_worker(model=str(folder), http=True) as s:
        yield s


@pytest.fixture(scope="module")
def want(folder):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(folder), device="cpu").rank(QUERY, DOCUMENTS)[:3]


def test_langchain_cohere_rerank(stack, want):
    import langchain_cohere
    from langchain_core.documents import Document

    reranker = langchain_cohere.CohereRerank(model=MODEL, base_url=stack.http_url, cohere_api_key="unused", top_n=3)
    docs = [Document(page_content=text, metadata={"i": i}) for i, text in enumerate(DOCUMENTS)]
    got = reranker.compress_documents(docs, QUERY)
    assert [d.metadata["i"] for d in got] == [w["corpus_id"] for w in want]
    assert [d.page_content for d in got] == [DOCUMENTS[w["corpus_id"]] for w in want]
    assert [d.metadata["relevance_score"] for d in got] == pytest.approx([w["score"] for w in want], abs=2e-5)


def test_llama_index_cohere_rerank(stack, want):
    from llama_index.core.schema import NodeWithScore, TextNode
    from llama_index.postprocessor import cohere_rerank

    reranker = cohere_rerank.CohereRerank(api_key="unused", model=MODEL, top_n=3, base_url=stack.http_url)
    nodes = [NodeWithScore(node=TextNode(text=text, id_=str(i))) for i, text in enumerate(DOCUMENTS)]
    got = reranker.postprocess_nodes(nodes, query_str=QUERY)
    assert [int(n.node.node_id) for n in got] == [w["corpus_id"] for w in want]
    assert [n.score for n in got] == pytest.approx([w["score"] for w in want], abs=2e-5)
