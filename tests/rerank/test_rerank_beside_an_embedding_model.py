"""One gateway serving an embedding model and a reranker: Info names each one's task, and a call
of the wrong kind is INVALID_ARGUMENT naming the model's task, before anything is queued."""

from __future__ import annotations

import grpc
import pytest
import redis
from gateway_support import running_gateway
from tiny_rerankers import DOCUMENTS, QUERY, build_bert_cross_encoder

from tokq import Client, TokqError


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    return build_bert_cross_encoder(tmp_path_factory.mktemp("beside") / "reranker")


def test_each_model_keeps_its_task(redis_url, reranker, bundled_model_dir):
    with running_gateway(redis_url, model=(str(bundled_model_dir), str(reranker))) as port:
        with Client(f"127.0.0.1:{port}", model="reranker") as client:
            info = client.info()
            assert info.task == "rerank"
            assert dict(info.tasks) == {"all-MiniLM-L6-v2": "embed", "reranker": "rerank"}
            with pytest.raises(TokqError) as err:
                client.embed(["text"])
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "task: rerank" in err.value.message
        with Client(f"127.0.0.1:{port}", model="all-MiniLM-L6-v2") as client:
            assert client.info().task == "embed"
            with pytest.raises(TokqError) as err:
                client.rerank(QUERY, DOCUMENTS)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "task: embed" in err.value.message
    r = redis.Redis.from_url(redis_url)
    try:
        assert not [k for k in r.keys("*") if b":reply:" in k or k.endswith((b"pending", b"heavy"))]
    finally:
        r.close()
