"""The service bench's baseline servers return the model's embeddings through the tokq.v1 gRPC API:
each input's vector matches sentence-transformers encoding it alone, whichever batch it rode in
(ONNX Runtime's too, on an ONNX export made here); and the bench's vector check refuses a server
whose vectors are not the model's."""

from __future__ import annotations

import asyncio
import contextlib
import random

import numpy as np
import pytest

from tokq import AsyncClient
from tokq.profiling.bench.baselines.onnx_model import OnnxSentenceEncoder, export
from tokq.profiling.bench.baselines.runners import make_runner
from tokq.profiling.bench.baselines.server import load_model, serve
from tokq.profiling.bench.service.cli import DEFAULT_INFINITY_BIN, optimum_cli_beside
from tokq.profiling.bench.service.systems import min_cosine


@pytest.fixture(scope="module")
def model():
    from tokq.workers.device import use_threads

    # One thread, as `tokq bench service` runs the baselines: two spin-waiting OpenMP threads on a
    # busy 2-core machine stall each other (10x slower here). The setting is process-wide.
    with use_threads(1):
        yield load_model()


def texts_of_mixed_lengths(bundled_model_dir, n: int, seed: int) -> list[str]:
    words = [w.strip() for w in open(bundled_model_dir / "vocab.txt", encoding="utf-8")
             if w.strip().isalpha() and w.strip().islower() and len(w.strip()) > 2][:20000]
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.choice([1, 3, 8, 20, 60, 300]))) for _ in range(n)]


@contextlib.asynccontextmanager
async def serving(runner, model):
    """The baseline's gRPC server on a free loopback port for the block; yields its target."""
    stop = asyncio.Event()
    ready: asyncio.Future = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(runner, model, port=0, stop=stop, on_ready=ready.set_result))
    try:
        yield f"127.0.0.1:{await asyncio.wait_for(ready, 30)}"
    finally:
        stop.set()
        await task


@pytest.mark.parametrize("kind", ["one-at-a-time", "padded-batching"])
async def test_baseline_embeddings_match_sentence_transformers(model, bundled_model_dir, kind):
    texts = texts_of_mixed_lengths(bundled_model_dir, 24, seed=11)  # some over 256 tokens: truncated
    want = np.stack([model.encode([t], normalize_embeddings=True)[0] for t in texts])
    runner = make_runner(kind, model, max_batch_size=8, max_wait_ms=50)
    async with serving(runner, model) as target:
        async with AsyncClient(target) as client:
            # One request per input, all at once: the padded baseline batches them together.
            singles = await asyncio.gather(*(client.embed([t], truncate=True) for t in texts))
            together = await client.embed(texts[:5], truncate=True)
            info = await client.info()
    got = np.concatenate(singles)
    assert got.shape == want.shape and got.dtype == np.float32
    assert min_cosine(got, want) >= 0.9999
    assert min_cosine(together, want[:5]) >= 0.9999
    assert info.dimensions == want.shape[1] and info.max_input_length == model.max_seq_length
    if kind == "padded-batching":
        assert 3 <= runner.num_batches < len(texts)  # batches of up to 8 inputs, not one per request


async def test_padded_batching_skips_requests_whose_caller_left(model):
    runner = make_runner("padded-batching", model, max_batch_size=4, max_wait_ms=200)
    await runner.start()
    try:
        gone = asyncio.create_task(runner.embed(["left before its batch ran"]))
        await asyncio.sleep(0.01)
        gone.cancel()
        kept = await runner.embed(["still here"])
    finally:
        await runner.stop()
    assert kept.vectors.shape == (1, model.get_embedding_dimension())
    assert runner.num_batches == 1 and runner.num_inputs == 1  # the cancelled input was never encoded
    assert kept.num_tokens == 4  # [CLS] still here [SEP]


@pytest.fixture(scope="module")
def onnx_export(bundled_model_dir, tmp_path_factory):
    return export(bundled_model_dir, tmp_path_factory.mktemp("onnx"))


async def test_onnx_runtime_baseline_matches_sentence_transformers(model, bundled_model_dir, onnx_export):
    assert "torch.onnx.export" in onnx_export.exporter  # no optimum in this environment
    encoder = OnnxSentenceEncoder(onnx_export.path, threads=1)
    texts = texts_of_mixed_lengths(bundled_model_dir, 16, seed=5)  # some over 256 tokens: truncated
    want = np.stack([model.encode([t], normalize_embeddings=True)[0] for t in texts])
    runner = make_runner("onnx-one-at-a-time", encoder)
    async with serving(runner, encoder) as target:
        async with AsyncClient(target) as client:
            singles = await asyncio.gather(*(client.embed([t], truncate=True) for t in texts))
            info = await client.info()
    got = np.concatenate(singles)
    assert got.shape == want.shape and got.dtype == np.float32
    assert min_cosine(got, want) >= 0.9999
    assert info.version.endswith("onnx-one-at-a-time") and info.max_input_length == 256


@pytest.mark.skipif(optimum_cli_beside(str(DEFAULT_INFINITY_BIN)) is None,
                    reason="optimum lives in .venv-infinity (make .venv-infinity/bin/infinity_emb)")
def test_optimum_export_gives_the_models_vectors(model, bundled_model_dir, tmp_path):
    made = export(bundled_model_dir, tmp_path / "onnx", optimum_cli=optimum_cli_beside(str(DEFAULT_INFINITY_BIN)))
    assert made.exporter.startswith("optimum-onnx")
    texts = texts_of_mixed_lengths(bundled_model_dir, 8, seed=6)
    got = OnnxSentenceEncoder(made.path, threads=1).encode(texts, batch_size=1)
    want = model.encode(texts, batch_size=1, normalize_embeddings=True)
    assert min_cosine(got, want) >= 0.9999


async def test_bench_vector_check_refuses_a_server_whose_vectors_are_not_the_models(model, bundled_model_dir):
    """The bench's check, against the bare server (a constant vector) and the real baseline."""
    from tokq.profiling.bench.service.run import check_vectors
    from tokq.profiling.bench.service.systems import RunningSystem, SystemSpec
    from tokq.profiling.harness import BareServer

    texts = texts_of_mixed_lengths(bundled_model_dir, 6, seed=7)
    probe = (texts, np.stack([model.encode([t], normalize_embeddings=True)[0] for t in texts]))
    bare = await asyncio.to_thread(BareServer)
    try:
        wrong = await check_vectors(RunningSystem(SystemSpec("echo", "one-at-a-time"), bare.target, bare.proc), probe)
    finally:
        bare.close()
    assert not wrong["counts"] and wrong["min_cos"] < 0.9 and "differ from sentence-transformers" in wrong["why"]
    async with serving(make_runner("one-at-a-time", model), model) as target:
        right = await check_vectors(RunningSystem(SystemSpec("st", "one-at-a-time"), target, None), probe)
    assert right["counts"] and right["min_cos"] >= 0.9999 and right["num_probes"] == 6
