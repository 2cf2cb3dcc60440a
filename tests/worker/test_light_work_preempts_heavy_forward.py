"""Light work pre-empts a heavy forward (workers/preempt.py), in process with a real Redis and
the real bundled model: a one-word request that arrives while a heavy batch is in its forward is
run nested between two of that forward's blocks and answered before the heavy batch is, and
both batches' vectors are those of the model run alone. The order is forced with events in
front of the real engine, never by timing."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from prometheus_client import REGISTRY
from gated_engine import HEAVY_TOKENS, GatedEngine
from gated_worker import fp32_engine, hold_heavy_checkpoint, offered, token_ids, worker_rig
from queue_support import answered_vectors, enqueue_ids, ok_result, open_queue, wait_for

from tokq.batch import PackedBatch
from tokq.queue.wire import encode_body
from tokq.metrics import WorkerMetrics
from tokq.workers.loop import is_heavy

pytestmark = pytest.mark.slow

LEASE_MS = 3_000  # long enough that a busy machine misses no renewal


@pytest.fixture(scope="module")
def engine():
    return fp32_engine()


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


async def test_only_a_batch_holding_heavy_lane_work_is_pre_empted(redis_url):
    """Light work is not pre-empted, however many tokens its batch holds, nor a batch mostly of
    light work: light work arriving during such a forward waits for the next full batch."""
    async with open_queue(redis_url) as q:
        def body(n):
            return n, encode_body(np.arange(1, n + 1))

        for i in range(3):  # 3 light requests of 60 tokens: a 180-token batch, all light lane
            await q.enqueue(f"light{i}", [body(60)], timeout_ms=60_000, notice_channel=q.keys.notice_channel("t"))
        light = await q.claim(512)
        assert light.num_tokens == 180 and light.num_heavy == 0
        assert not is_heavy(light, HEAVY_TOKENS)
        await q.enqueue("small", [body(10)], timeout_ms=60_000, notice_channel=q.keys.notice_channel("t"))
        await q.enqueue("big", [body(100), body(100)], timeout_ms=60_000, notice_channel=q.keys.notice_channel("t"))
        mixed = await q.claim(512)
        assert mixed.num_tokens == 210 and mixed.num_heavy == 2  # the light item first, then the heavy ones
        assert is_heavy(mixed, HEAVY_TOKENS)
        assert not is_heavy(mixed, 210)  # no more tokens than a light-only claim: not worth it
        for i in range(4):
            await q.enqueue(f"light-{i}", [body(60)], timeout_ms=60_000, notice_channel=q.keys.notice_channel("t"))
        await q.enqueue("big2", [body(200)], timeout_ms=60_000, notice_channel=q.keys.notice_channel("t"))
        mostly_light = await q.claim(512)
        assert mostly_light.num_tokens == 440 and mostly_light.num_heavy == 1
        assert not is_heavy(mostly_light, HEAVY_TOKENS)  # 200 of 440 tokens heavy: under half


async def test_a_light_request_runs_inside_a_heavy_forward_and_is_answered_first(redis_url, engine):
    gated = GatedEngine(engine)
    rng = np.random.default_rng(7)
    heavy_ids = [token_ids(rng, 100) for _ in range(2)]
    light_ids = [np.array([101, 7592, 2088, 102])]
    name = engine.info.queue_name
    metrics = WorkerMetrics(name, "preempt")
    async with worker_rig(redis_url, engine) as rig:
        q, client = rig.q, rig.client
        worker = rig.worker(gated, "preempt", observer=metrics)
        assert worker.budget.preempt_budget == HEAVY_TOKENS
        await rig.start(worker)

        # light is claimed on its 'light' wake-up (or by the first light-only claim, if that ran
        # after its enqueue: it follows the registration)
        await rig.offer_during_heavy(worker, gated.heavy_entered, ("heavy", heavy_ids), ("light", light_ids))
        gated.go.set()  # the heavy forward starts; its first block's checkpoint runs the light one
        got = {"light": await answered_vectors(client, "light", len(light_ids))}
        assert not await q.redis.hexists(q.keys.reply("heavy"), "0")  # heavy still unanswered
        gated.finish.set()
        got["heavy"] = await answered_vectors(client, "heavy", len(heavy_ids))
        heavy_n, light_n = sum(map(len, heavy_ids)), sum(map(len, light_ids))
        assert gated.log == [("start", heavy_n), ("start", light_n), ("end", light_n), ("end", heavy_n)]

        for request_id, seqs in (("light", light_ids), ("heavy", heavy_ids)):
            alone = engine.embed(PackedBatch.pack(seqs))
            assert _cosines(got[request_id], alone).min() >= 0.9999, request_id
            np.testing.assert_allclose(got[request_id], alone, atol=1e-5)

        assert worker.loop.num_preemptions == 1 and worker.loop.num_batches == 2
        assert REGISTRY.get_sample_value("tokq_worker_preemptions_total",
                                         {"model": name, "worker": "preempt"}) == 1
        stats = await q.stats()
        assert (stats.inflight_items, stats.queued_entries, stats.counters["acked"]) == (0, 0, 3)
        assert await q.redis.scard(q.keys.preemptible) == 0  # the heavy forward is over
        await rig.stop(worker)
        metrics.close()
        assert rig.exits == []


async def test_a_worker_lost_while_a_light_batch_waits_inside_its_heavy_forward_has_both_redone(
        redis_url, engine):
    # The worker is stopped dead (its task cancelled, its subscription closed: a crash as Redis
    # sees it) holding a heavy batch in its forward and a light batch offered to it.
    gated = GatedEngine(engine)
    rng = np.random.default_rng(8)
    heavy_ids = [token_ids(rng, 150)]
    light_ids = [np.array([101, 2204, 2851, 102]), np.array([101, 7592, 102])]
    async with worker_rig(redis_url, engine, lease_ms=LEASE_MS) as rig:
        q, q2 = rig.q, rig.client
        lost = rig.worker(gated, "lost")
        await rig.start(lost)
        for request_id, seqs in (("heavy", heavy_ids), ("light", light_ids)):
            await enqueue_ids(q2, request_id, seqs)
            if request_id == "heavy":
                assert await asyncio.to_thread(gated.heavy_entered.wait, 60)
        await wait_for(offered(lost), 30, "the light batch to be offered to the heavy forward")
        assert (await q.stats()).inflight_items == 3  # both batches leased to the lost worker
        await rig.kill(lost)

        redo = rig.worker(engine, "redo", queue=q2)
        await rig.start(redo)
        for request_id, seqs in (("heavy", heavy_ids), ("light", light_ids)):
            got = await answered_vectors(q2, request_id, len(seqs))
            np.testing.assert_allclose(got, engine.embed(PackedBatch.pack(seqs)), atol=1e-5)
        stats = await q2.stats()
        assert stats.counters["requeued"] == 3 and stats.counters["acked"] == 3
        assert stats.inflight_items == 0

        gated.go.set()  # the lost forward thread runs on to its end, both batches, for nobody
        gated.finish.set()

        async def lost_thread_done():
            return len(gated.log) == 4
        await wait_for(lost_thread_done, 60, "the lost worker's forward thread to end")
        await rig.stop(redo)
        assert (await q2.stats()).counters["acked"] == 3  # the lost worker acknowledged nothing
        assert rig.exits == []


async def test_light_work_claimed_before_the_heavy_forward_thread_starts_runs_nested(
        redis_url, engine, monkeypatch):
    """The heavy forward's thread may start after the pre-empting claim (a busy executor, a
    loaded machine: CI saw it): light work claimed meanwhile waits in the slot for the heavy
    forward's first checkpoint. Before, the slot was armed only once the thread ran, the offer
    was refused and the light batch ran as a second forward beside the heavy one."""
    gated = GatedEngine(engine)
    gated.go.set()  # here the thread's start is held instead of the heavy embed
    thread_may_start = threading.Event()
    rng = np.random.default_rng(10)
    heavy_ids = [token_ids(rng, 150)]
    light_ids = [np.array([101, 7592, 102])]
    async with worker_rig(redis_url, engine) as rig:
        client = rig.client
        worker = rig.worker(gated, "late")
        real_run_heavy = worker.loop.run_heavy

        def late_run_heavy(claim):
            assert thread_may_start.wait(60)
            return real_run_heavy(claim)
        monkeypatch.setattr(worker.loop, "run_heavy", late_run_heavy)
        await rig.start(worker)

        await enqueue_ids(client, "heavy", heavy_ids)
        await wait_for(rig.registered, 30, "the worker with a heavy batch to register as pre-emptible")
        await enqueue_ids(client, "light", light_ids)

        async def offered_or_run():
            return worker.loop.preemption.waiting is not None or gated.log
        await wait_for(offered_or_run, 30, "the light batch to be offered, or run")
        assert gated.log == [] and worker.loop.preemption.waiting is not None
        thread_may_start.set()
        gated.finish.set()
        got = {"light": await answered_vectors(client, "light", len(light_ids)),
               "heavy": await answered_vectors(client, "heavy", len(heavy_ids))}
        light_n, heavy_n = sum(map(len, light_ids)), sum(map(len, heavy_ids))
        assert gated.log == [("start", heavy_n), ("start", light_n), ("end", light_n), ("end", heavy_n)]
        assert worker.loop.num_preemptions == 1
        for request_id, seqs in (("light", light_ids), ("heavy", heavy_ids)):
            np.testing.assert_allclose(got[request_id], engine.embed(PackedBatch.pack(seqs)), atol=1e-5)
        await rig.stop(worker)
        assert rig.exits == []


def _light1_lands_while_registering(monkeypatch, rig, worker, seqs, then=None) -> None:
    """At the worker's first registration as pre-emptible, light1 is enqueued (its 'light'
    wake-up pops the worker from the set) and the worker reads that wake-up; then ``then()``."""
    real_mark = worker.queue.consumer.mark_preemptible
    sent = False

    async def mark_then_notice(preemptible: bool) -> None:
        nonlocal sent
        await real_mark(preemptible)
        if preemptible and not sent:  # the first registration only
            sent = True
            await enqueue_ids(rig.client, "light1", seqs)  # pops this worker: 'light'

            async def notice_read():
                return worker.wake.preemptible.wakeups == 1
            await wait_for(notice_read, 30, "the worker to read light1's notice")
            if then is not None:
                await then()
    monkeypatch.setattr(worker.queue.consumer, "mark_preemptible", mark_then_notice)


@pytest.mark.parametrize("race", [False, True], ids=["notice_after_registering", "notice_while_registering"])
async def test_light_requests_one_after_another_each_pre_empt_the_same_heavy_forward(
        redis_url, engine, monkeypatch, race):
    """After a light batch ran nested, the worker registers again: the next light request, on
    its own notice, runs nested in the same heavy forward. The heavy forward holds at its second
    checkpoint until that request is offered (events, not timing). ``race``: the first light
    request lands, and its notice is read, while the worker's registration is in flight: that
    notice took it out of the set, so it must not believe itself registered (it would then get
    no notice for the second request, which would wait for the whole heavy forward)."""
    gated = GatedEngine(engine)
    rng = np.random.default_rng(9)
    heavy_ids = [token_ids(rng, 150)]
    light_ids = {"light1": [np.array([101, 7592, 102])], "light2": [np.array([101, 2088, 2003, 102])]}
    async with worker_rig(redis_url, engine) as rig:
        q, client = rig.q, rig.client
        worker = rig.worker(gated, "twice")
        hold_heavy_checkpoint(monkeypatch, gated, worker, 2, "light2")
        await rig.start(worker)

        if race:
            _light1_lands_while_registering(monkeypatch, rig, worker, light_ids["light1"])
        await enqueue_ids(client, "heavy", heavy_ids)
        assert await asyncio.to_thread(gated.heavy_entered.wait, 60)
        if not race:
            await wait_for(rig.registered, 30, "the worker in a heavy forward to register as pre-emptible")
            await enqueue_ids(client, "light1", light_ids["light1"])
        await wait_for(offered(worker), 30, "light1 to be offered to the forward")
        gated.go.set()  # checkpoint 1 runs light1; checkpoint 2 holds until light2 is offered
        got = {"light1": await answered_vectors(client, "light1", 1)}
        await wait_for(rig.registered, 30, "the worker to register again after light1")
        await enqueue_ids(client, "light2", light_ids["light2"])
        got["light2"] = await answered_vectors(client, "light2", 1)
        assert not await q.redis.hexists(q.keys.reply("heavy"), "0")
        gated.finish.set()
        got["heavy"] = await answered_vectors(client, "heavy", len(heavy_ids))
        n1, n2, heavy_n = (sum(map(len, light_ids["light1"])), sum(map(len, light_ids["light2"])),
                           sum(map(len, heavy_ids)))
        assert gated.log == [("start", heavy_n), ("start", n1), ("end", n1), ("start", n2),
                             ("end", n2), ("end", heavy_n)]
        assert worker.loop.num_preemptions == 2
        for request_id, seqs in (*light_ids.items(), ("heavy", heavy_ids)):
            np.testing.assert_allclose(got[request_id], engine.embed(PackedBatch.pack(seqs)), atol=1e-5)
        await rig.stop(worker)
        assert await q.redis.scard(q.keys.preemptible) == 0
        assert rig.exits == []


async def test_a_notice_read_while_registering_whose_work_went_elsewhere_leaves_it_registered(
        redis_url, engine, monkeypatch):
    """A 'light' wake-up read while the worker registers as pre-emptible took it out of the set;
    when another worker then takes that light work first, the worker's claim finds nothing. It
    must register again: otherwise it waits, in no set, for the rest of the heavy forward, and
    the next light request gets no notice and waits for all of it."""
    gated = GatedEngine(engine)
    rng = np.random.default_rng(11)
    heavy_ids = [token_ids(rng, 150)]
    light_ids = {"light1": [np.array([101, 7592, 102])], "light2": [np.array([101, 2088, 2003, 102])]}
    async with worker_rig(redis_url, engine) as rig:
        client = rig.client
        worker = rig.worker(gated, "passed-over")
        stolen = []

        async def another_worker_answers_light1() -> None:
            # Another worker's claim lands first; it answers light1 (nothing left leased).
            claim = await client.claim(512, lanes="light")
            stolen.append(claim)
            await client.ack(claim.batch_id, [(e, ok_result(e)) for e in claim.entries])
        _light1_lands_while_registering(monkeypatch, rig, worker, light_ids["light1"],
                                        then=another_worker_answers_light1)
        await rig.start(worker)
        await enqueue_ids(client, "heavy", heavy_ids)
        assert await asyncio.to_thread(gated.heavy_entered.wait, 60)

        async def registered_again():
            return len(stolen) == 1 and await rig.registered()
        await wait_for(registered_again, 30, "the worker to register again after its notice's work went elsewhere")
        assert [e.request_id for e in stolen[0].entries] == ["light1"]
        await enqueue_ids(client, "light2", light_ids["light2"])
        await wait_for(offered(worker), 30, "light2 to be offered to the forward")
        gated.go.set()
        got = {"light2": await answered_vectors(client, "light2", 1)}
        assert not await rig.q.redis.hexists(rig.q.keys.reply("heavy"), "0")
        gated.finish.set()
        got["heavy"] = await answered_vectors(client, "heavy", len(heavy_ids))
        n2, heavy_n = sum(map(len, light_ids["light2"])), sum(map(len, heavy_ids))
        assert gated.log == [("start", heavy_n), ("start", n2), ("end", n2), ("end", heavy_n)]
        assert worker.loop.num_preemptions == 1
        for request_id, seqs in (("light2", light_ids["light2"]), ("heavy", heavy_ids)):
            np.testing.assert_allclose(got[request_id], engine.embed(PackedBatch.pack(seqs)), atol=1e-5)
        await rig.stop(worker)
        assert await rig.q.redis.scard(rig.q.keys.preemptible) == 0
        assert rig.exits == []


class _RecordingMetrics(WorkerMetrics):
    """WorkerMetrics that also keeps each batch's (tokens, forward_s, token_budget)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[tuple[int, float, int]] = []

    def observe_batch(self, seqlens, *, token_budget: int, forward_s: float, **kwargs) -> None:
        self.batches.append((sum(seqlens), forward_s, token_budget))
        super().observe_batch(seqlens, token_budget=token_budget, forward_s=forward_s, **kwargs)


class _SlowLightEngine:
    """The gated engine; a light batch's forward takes ``light_s`` longer, and the heavy
    forward's wall time (nested batches in it) is kept."""

    def __init__(self, gated: GatedEngine, light_s: float) -> None:
        self._gated, self.light_s = gated, light_s
        self.heavy_wall_s = 0.0

    def __getattr__(self, name):
        return getattr(self._gated, name)

    def embed(self, batch):
        start = time.perf_counter()
        vectors = self._gated.embed(batch)
        if batch.num_tokens > HEAVY_TOKENS:
            self.heavy_wall_s = time.perf_counter() - start
        else:
            time.sleep(self.light_s)
        return vectors


async def _nest_one_light_batch(redis_url, engine, worker_id: str, *, light_s: float = 0.0):
    """A worker runs one heavy batch with one light batch nested at its first checkpoint.
    Returns (worker, its recording metrics, the engine, heavy tokens, light tokens)."""
    gated = GatedEngine(engine)
    slow = _SlowLightEngine(gated, light_s)
    rng = np.random.default_rng(12)
    heavy_ids = [token_ids(rng, 100) for _ in range(2)]
    light_ids = [np.array([101, 7592, 2088, 102])]
    metrics = _RecordingMetrics(engine.info.queue_name, worker_id)
    async with worker_rig(redis_url, engine) as rig:
        client = rig.client
        worker = rig.worker(slow, worker_id, observer=metrics)
        await rig.start(worker)
        await rig.offer_during_heavy(worker, gated.heavy_entered, ("heavy", heavy_ids), ("light", light_ids))
        gated.go.set()
        await answered_vectors(client, "light", len(light_ids))
        gated.finish.set()
        await answered_vectors(client, "heavy", len(heavy_ids))
        heavy_n, light_n = sum(map(len, heavy_ids)), sum(map(len, light_ids))
        assert gated.log == [("start", heavy_n), ("start", light_n), ("end", light_n), ("end", heavy_n)]
        assert worker.loop.num_preemptions == 1
        await rig.stop(worker)
        assert rig.exits == []
    return worker, metrics, slow, heavy_n, light_n


def _sample(metric: str, worker_id: str, model: str) -> float | None:
    return REGISTRY.get_sample_value(metric, {"model": model, "worker": worker_id})


async def test_a_nested_light_batch_is_left_out_of_the_fill_ratio(redis_url, engine):
    """A light batch claimed to pre-empt a heavy forward (up to the pre-emption budget, 1/4 of
    512 here) is not a measure of how full the worker's batches run: it is counted as a batch,
    but not in the fill ratio. Before, it was observed against the full budget (4/512), and a
    saturated worker under mixed load read a mean fill of 0.066, firing TokqBatchFillRatioLow."""
    worker, metrics, _, heavy_n, light_n = await _nest_one_light_batch(redis_url, engine, "fill")
    model = engine.info.queue_name
    try:
        assert sorted(metrics.batches)[0][0] == light_n  # observed as a batch all the same
        assert _sample("tokq_worker_batches_total", "fill", model) == 2
        assert _sample("tokq_worker_batch_fill_ratio_count", "fill", model) == 1  # the heavy one
        assert _sample("tokq_worker_batch_fill_ratio_sum", "fill", model) == pytest.approx(heavy_n / 512)
        assert _sample("tokq_worker_budget_tokens", "fill", model) == 512  # never the light budget
    finally:
        metrics.close()


async def test_a_heavy_forwards_time_leaves_out_the_light_batch_nested_in_it(redis_url, engine):
    """The light batch nested in a heavy forward is timed in its own forward; the heavy one's
    leaves it out, so the forward seconds add up to no more than the wall clock. Before, the
    nested time counted in both (24.6 forward seconds in a 20 s run on one CPU worker)."""
    light_s = 0.5
    worker, metrics, slow, heavy_n, light_n = await _nest_one_light_batch(
        redis_url, engine, "forward-s", light_s=light_s)
    model = engine.info.queue_name
    try:
        forward_s = {tokens: seconds for tokens, seconds, _ in metrics.batches}
        assert forward_s[light_n] >= light_s
        # The heavy run's wall time holds the light batch's; out of it only decoding and
        # packing two items, milliseconds (the slack is for a loaded machine).
        assert slow.heavy_wall_s >= light_s
        assert forward_s[heavy_n] < slow.heavy_wall_s - light_s + light_s / 2
        total = _sample("tokq_worker_forward_duration_seconds_sum", "forward-s", model)
        assert total == pytest.approx(forward_s[heavy_n] + forward_s[light_n])
        assert total < slow.heavy_wall_s + light_s / 2
        assert _sample("tokq_worker_forward_tokens_total", "forward-s", model) == heavy_n + light_n
        # The next claim's timing still sees the forward's wall time, the nested batch in it.
        assert worker.loop.prefetch.forward_s >= light_s
    finally:
        metrics.close()


async def test_a_light_batch_offered_too_late_to_nest_is_not_counted_as_a_preemption(redis_url, engine):
    """Light work offered after the heavy forward's last checkpoint runs right after it, in its
    thread (Preemption.heavy): answered, counted as a batch, but it pre-empted nothing.
    Before, every offered batch counted in tokq_worker_preemptions_total."""
    gated = GatedEngine(engine)
    rng = np.random.default_rng(13)
    heavy_ids = [token_ids(rng, 150)]
    light_ids = [np.array([101, 7592, 102])]
    name = engine.info.queue_name
    metrics = WorkerMetrics(name, "too-late")
    async with worker_rig(redis_url, engine) as rig:
        client = rig.client
        worker = rig.worker(gated, "too-late", observer=metrics)
        await rig.start(worker)
        await enqueue_ids(client, "heavy", heavy_ids)
        assert await asyncio.to_thread(gated.heavy_entered.wait, 60)
        await wait_for(rig.registered, 30, "the worker in a heavy forward to register")
        gated.go.set()  # the heavy forward runs through all its checkpoints, then holds
        heavy_n, light_n = sum(map(len, heavy_ids)), sum(map(len, light_ids))

        async def heavy_passed_its_checkpoints():
            return ("end", heavy_n) in gated.log
        await wait_for(heavy_passed_its_checkpoints, 30, "the heavy forward to pass its last checkpoint")
        await enqueue_ids(client, "light", light_ids)
        await wait_for(offered(worker), 30, "the light batch to be offered to the (still armed) forward")
        gated.finish.set()
        await answered_vectors(client, "light", len(light_ids))
        await answered_vectors(client, "heavy", len(heavy_ids))
        assert gated.log == [("start", heavy_n), ("end", heavy_n), ("start", light_n), ("end", light_n)]
        assert worker.loop.num_preemptions == 0 and worker.loop.num_batches == 2
        assert REGISTRY.get_sample_value("tokq_worker_preemptions_total",
                                         {"model": name, "worker": "too-late"}) in (None, 0.0)
        await rig.stop(worker)
        metrics.close()
        assert rig.exits == []


async def test_a_light_backlog_beside_a_heavy_forward_goes_in_one_full_batch_not_nested(
        redis_url, engine, monkeypatch):
    """Light work that lands in a heavy forward faster than a light-only claim takes it (180
    tokens past its 128) is a backlog: the light-only claim refuses it (counted as 'backlog')
    and it runs in the next full batch, whole, after the heavy forward. Cut into nested
    batches it ran as many small forwards. Light claims wait on an event until it is queued."""
    gated = GatedEngine(engine)
    rng = np.random.default_rng(14)
    heavy_ids = [token_ids(rng, 150)]
    light_ids = {f"light{i}": [token_ids(rng, 60)] for i in range(3)}
    name = engine.info.queue_name
    metrics = WorkerMetrics(name, "backlog")
    async with worker_rig(redis_url, engine) as rig:
        client = rig.client
        worker = rig.worker(gated, "backlog", observer=metrics)
        light_claims_may_run = asyncio.Event()
        light_answers: list = []
        real_claim = worker.queue.consumer.claim

        async def gated_claim(token_budget, **kwargs):
            if kwargs.get("lanes") == "light":
                await light_claims_may_run.wait()
                answer = await real_claim(token_budget, **kwargs)
                light_answers.append(answer)
                return answer
            return await real_claim(token_budget, **kwargs)
        monkeypatch.setattr(worker.queue.consumer, "claim", gated_claim)
        await rig.start(worker)
        await enqueue_ids(client, "heavy", heavy_ids)
        assert await asyncio.to_thread(gated.heavy_entered.wait, 60)
        for request_id, seqs in light_ids.items():
            await enqueue_ids(client, request_id, seqs)
        light_claims_may_run.set()

        async def refused():
            return light_answers and light_answers[0] is None
        await wait_for(refused, 30, "the light-only claim to refuse the backlog")
        assert worker.loop.preemption.waiting is None
        gated.go.set()
        gated.finish.set()
        for request_id, seqs in light_ids.items():
            await answered_vectors(client, request_id, 1)
        await answered_vectors(client, "heavy", 1)
        assert gated.log == [("start", 150), ("end", 150), ("start", 180), ("end", 180)]
        assert worker.loop.num_preemptions == 0 and all(a is None for a in light_answers)
        assert REGISTRY.get_sample_value("tokq_worker_claim_stops_total",
                                         {"model": name, "worker": "backlog", "reason": "backlog"}) >= 1
        await rig.stop(worker)
        metrics.close()
        assert rig.exits == []


async def test_a_heavy_forward_stops_nesting_once_nested_batches_hold_the_pre_emption_budget(
        redis_url, engine, monkeypatch):
    """Two light requests of 100 tokens each run nested (the second one's claim came while the
    nested tokens, 100, were under the 128 of the pre-emption budget); a third light request
    then waits for the heavy forward's end and runs after it: nesting is for light work that
    arrives a little at a time, and bounded per heavy forward. Checkpoints held by events."""
    gated = GatedEngine(engine)
    rng = np.random.default_rng(15)
    heavy_ids = [token_ids(rng, 150)]
    light_ids = {"light1": [token_ids(rng, 100)], "light2": [token_ids(rng, 100)], "light3": [token_ids(rng, 10)]}
    async with worker_rig(redis_url, engine) as rig:
        q, client = rig.q, rig.client
        worker = rig.worker(gated, "bounded")
        hold_heavy_checkpoint(monkeypatch, gated, worker, 2, "light2")
        await rig.start(worker)
        await rig.offer_during_heavy(worker, gated.heavy_entered, ("heavy", heavy_ids),
                                     ("light1", light_ids["light1"]))
        gated.go.set()  # checkpoint 1 runs light1; checkpoint 2 holds until light2 is offered
        await answered_vectors(client, "light1", 1)
        await wait_for(rig.registered, 30, "the worker to register again after light1")
        await enqueue_ids(client, "light2", light_ids["light2"])
        await answered_vectors(client, "light2", 1)

        async def unregistered():
            return not await rig.registered()
        await wait_for(unregistered, 30, "the worker to stop taking nested batches")
        await enqueue_ids(client, "light3", light_ids["light3"])
        assert worker.loop.preemption.waiting is None
        assert not await q.redis.hexists(q.keys.reply("heavy"), "0")  # the heavy forward still runs
        gated.finish.set()
        await answered_vectors(client, "heavy", 1)
        await answered_vectors(client, "light3", 1)
        assert gated.log == [("start", 150), ("start", 100), ("end", 100), ("start", 100),
                             ("end", 100), ("end", 150), ("start", 10), ("end", 10)]
        assert worker.loop.num_preemptions == 2
        await rig.stop(worker)
        assert rig.exits == []
