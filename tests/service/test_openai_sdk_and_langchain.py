"""Clients nobody here wrote: the official `openai` SDK and langchain-openai's OpenAIEmbeddings,
against a live gateway and worker, checked against sentence-transformers."""

from __future__ import annotations

import base64
import signal
import time

import numpy as np
import openai
import pytest


pytestmark = pytest.mark.slow
MODEL = "all-MiniLM-L6-v2"
API_KEY = "sdk-test-key"  # the gateway takes calls only with this key (Bearer)
TEXTS = ["a red running shoe", "blue suede shoes", "the quarterly earnings report", "hello"]


@pytest.fixture(scope="module")
def stack():
    from service_stack import gateway_and_worker

    # Calls without a deadline of their own wait 3 s at most: a stopped worker gives a prompt 504.
    with gateway_and_worker(http=True, env={"TOKQ_DEFAULT_TIMEOUT_MS": "3000", "TOKQ_MAX_QUEUED_TOKENS": "2000",
                                            "TOKQ_API_KEYS": API_KEY}) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    # max_retries=0: the SDK retries 429/5xx by default, and these tests want to see them.
    with openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def reference(bundled_model_dir):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(bundled_model_dir), device="cpu")
    return lambda texts: model.encode(texts, normalize_embeddings=True)


def assert_close(got, want) -> None:
    got = np.asarray(got, dtype=np.float32)
    assert got.shape == want.shape
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cos.min() >= 0.9999, f"min cosine {cos.min()}"


def vectors(response) -> np.ndarray:
    return np.array([d.embedding for d in sorted(response.data, key=lambda d: d.index)], dtype=np.float32)


def test_sdk_embeddings_equal_sentence_transformers(client, reference):
    # The SDK asks for base64 by default and decodes it itself.
    resp = client.embeddings.create(model=MODEL, input=TEXTS)
    assert resp.model == MODEL and resp.usage.prompt_tokens > len(TEXTS)
    assert_close(vectors(resp), reference(TEXTS))
    one = client.embeddings.create(model=MODEL, input="hello")
    assert_close(vectors(one), reference(["hello"]))


def test_base64_decodes_to_the_same_floats(client):
    floats = vectors(client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float"))
    b64 = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="base64")
    decoded = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in b64.data])
    np.testing.assert_array_equal(decoded, floats)


def test_dimensions_are_honoured(client, reference):
    resp = client.embeddings.create(model=MODEL, input=TEXTS, dimensions=64)
    full = reference(TEXTS)[:, :64]
    assert vectors(resp).shape == (len(TEXTS), 64)
    assert_close(vectors(resp), full / np.linalg.norm(full, axis=1, keepdims=True))


def test_token_array_inputs(client, reference, bundled_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(bundled_model_dir))
    ids = [tok(t)["input_ids"] for t in TEXTS]
    assert_close(vectors(client.embeddings.create(model=MODEL, input=ids)), reference(TEXTS))
    assert_close(vectors(client.embeddings.create(model=MODEL, input=ids[0])), reference(TEXTS[:1]))


def test_langchain_openai_embeddings(stack, reference):
    from langchain_openai import OpenAIEmbeddings

    # check_embedding_ctx_length=False: send text, not tiktoken ids (another model's vocabulary).
    emb = OpenAIEmbeddings(model=MODEL, base_url=f"{stack.http_url}/v1", api_key=API_KEY,
                           check_embedding_ctx_length=False, max_retries=0, chunk_size=512)
    assert_close(emb.embed_documents(TEXTS), reference(TEXTS))
    assert_close([emb.embed_query(TEXTS[0])], reference(TEXTS[:1]))
    # The README's settings: more documents than one request may carry (512) go in several
    # (langchain's own chunk_size, 1,000, is refused).
    many = [TEXTS[i % len(TEXTS)] for i in range(600)]
    assert_close(emb.embed_documents(many), reference(many))


def test_models_list(client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


@pytest.mark.parametrize("kwargs, error, status", [
    (dict(input=""), openai.BadRequestError, 400),
    (dict(input=["ok", ""]), openai.BadRequestError, 400),
    (dict(input="hi", dimensions=385), openai.BadRequestError, 400),
    (dict(input=[[101, 999999]]), openai.BadRequestError, 400),
    (dict(input="hi", model="no-such-model"), openai.NotFoundError, 404),
])
def test_bad_input_raises_the_sdks_own_errors(client, kwargs, error, status):
    with pytest.raises(error) as err:
        client.embeddings.create(**{"model": MODEL, **kwargs})
    assert err.value.status_code == status and err.value.body["message"]


def test_a_wrong_api_key_is_the_sdks_authentication_error(stack):
    with openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="not-the-key", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError) as err:
            wrong.embeddings.create(model=MODEL, input="hi")
    assert err.value.status_code == 401


def test_a_stalled_worker_gives_504_and_overload_429(stack, client):
    from concurrent.futures import ThreadPoolExecutor

    stack.signal_worker("w1", signal.SIGSTOP)  # nobody claims: calls can only wait or time out
    try:
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(client.embeddings.create, model=MODEL, input=["token " * 120] * 12)
            r, keys = stack.client(), stack.keys
            while not int(r.get(keys.tokens) or 0):  # ~1,500 tokens now queued
                assert not waiting.done(), waiting.result()
                time.sleep(0.02)
            # the 2,000-token cap of a non-empty queue: the whole request is refused
            with pytest.raises(openai.RateLimitError) as err:
                client.embeddings.create(model=MODEL, input=["token " * 120] * 6)
            assert err.value.status_code == 429 and err.value.response.headers["retry-after"] == "1"
            with pytest.raises(openai.InternalServerError) as err:
                waiting.result()
            assert err.value.status_code == 504  # its 3 s default deadline passed
    finally:
        stack.signal_worker("w1", signal.SIGCONT)
    assert len(client.embeddings.create(model=MODEL, input="served again").data) == 1
