"""A Rerank call's priority class reaches the queue as an Embed call's does: gRPC's Priority, the
Cohere, Jina and TEI bodies' "priority" (Cohere's integer too: 0 interactive, higher batch), else
the API key's default, else interactive; `tokq rerank --priority`; an unknown class refused
before anything is queued. A real gateway in this process serving a tiny BERT cross-encoder,
its ``Producer.enqueue`` recording each ``priority=`` and answering "queue full"."""

from __future__ import annotations

import grpc
import httpx
import pytest
from click.testing import CliRunner
from gateway_support import record_enqueues, running_gateway
from tiny_rerankers import DOCUMENTS, QUERY, build_bert_cross_encoder

from tokq import Client, TokqError
from tokq.client_cli import rerank_command
from tokq.redis.embedded import free_port
from tokq.v1 import embedder_pb2 as pb
from tokq.v1 import embedder_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_bert_cross_encoder(tmp_path_factory.mktemp("rerank_priority") / "bert-reranker")


@pytest.fixture
def enqueued(monkeypatch):
    return record_enqueues(monkeypatch)


@pytest.fixture
def gateway(redis_url, folder):
    http_port = free_port()
    with running_gateway(redis_url, model=(str(folder),), http_port=http_port,
                         api_keys=("plain-key", "bulk-key priority=batch")) as port:
        yield f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}"


def test_grpc_rerank_and_tokq_rerank_queue_in_the_class_asked_else_the_keys(gateway, enqueued):
    target, _ = gateway
    for key, asked, want in [("plain-key", None, "interactive"), ("plain-key", "batch", "batch"),
                             ("bulk-key", None, "batch"), ("bulk-key", "interactive", "interactive")]:
        with Client(target, api_key=key) as client, pytest.raises(TokqError, match="RESOURCE_EXHAUSTED"):
            client.rerank(QUERY, DOCUMENTS, priority=asked, timeout=10)
        assert enqueued[-1] == want, (key, asked)
    result = CliRunner().invoke(rerank_command, ["--target", target, "--priority", "batch", QUERY, *DOCUMENTS],
                                env={"TOKQ_API_KEY": "plain-key"})
    assert result.exit_code == 1 and "RESOURCE_EXHAUSTED" in result.output
    assert enqueued[-1] == "batch"
    with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError) as err:
        pb_grpc.EmbedderStub(channel).Rerank(pb.RerankRequest(query=QUERY, documents=DOCUMENTS, priority=9),
                                             timeout=10, metadata=(("authorization", "Bearer plain-key"),))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "priority 9" in err.value.details()
    assert len(enqueued) == 5


@pytest.mark.parametrize("route", ["/v1/rerank", "/v2/rerank"])
def test_cohere_and_jina_bodies_take_a_class_name_or_cohere_integers(gateway, enqueued, route):
    _, http_url = gateway
    cases = [("plain-key", {}, "interactive"), ("plain-key", {"priority": "batch"}, "batch"),
             ("plain-key", {"priority": 0}, "interactive"), ("plain-key", {"priority": 3}, "batch"),
             ("bulk-key", {}, "batch"), ("bulk-key", {"priority": "interactive"}, "interactive"),
             ("bulk-key", {"priority": 0}, "interactive")]
    for key, extra, want in cases:
        reply = httpx.post(f"{http_url}{route}", json={"query": QUERY, "documents": DOCUMENTS} | extra,
                           headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert reply.status_code == 429, reply.text
        assert enqueued[-1] == want, (key, extra)
    for bad in (-1, "BATCH", 1.5, True):
        reply = httpx.post(f"{http_url}{route}", json={"query": QUERY, "documents": DOCUMENTS, "priority": bad},
                           headers={"Authorization": "Bearer plain-key"}, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "priority", reply.text
    assert len(enqueued) == len(cases)


def test_tei_body_takes_a_class_name(gateway, enqueued):
    _, http_url = gateway
    for key, extra, want in [("plain-key", {"priority": "batch"}, "batch"), ("bulk-key", {}, "batch"),
                             ("plain-key", {}, "interactive")]:
        reply = httpx.post(f"{http_url}/rerank", json={"query": QUERY, "texts": DOCUMENTS} | extra,
                           headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert reply.status_code == 429, reply.text
        assert enqueued[-1] == want
    reply = httpx.post(f"{http_url}/rerank", json={"query": QUERY, "texts": DOCUMENTS, "priority": 1},
                       headers={"Authorization": "Bearer plain-key"}, timeout=30)
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == 'priority must be "interactive" or "batch", got 1'
    assert len(enqueued) == 3


def test_without_api_keys_an_unset_class_is_interactive(redis_url, folder, enqueued):
    with running_gateway(redis_url, model=(str(folder),)) as port, Client(f"127.0.0.1:{port}") as client:
        for asked, want in [(None, "interactive"), ("batch", "batch")]:
            with pytest.raises(TokqError, match="RESOURCE_EXHAUSTED"):
                client.rerank(QUERY, DOCUMENTS, priority=asked, timeout=10)
            assert enqueued[-1] == want
