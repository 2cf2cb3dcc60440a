"""A worker with no budget set or published cuts its device's default to the latency goal
(workers/budget.py): the rule on modelled forward times, then a real worker (the bundled
model, a real Redis) whose heartbeat reports the budget it chose and where it came from. Goals
are picked so that the outcome holds on any machine: 1 ms is out of reach for any forward of
MiniLM, a day is within reach of every one."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import numpy as np
import pytest
from queue_support import QUEUE, open_queue

from tokq.config import QueueConfig, WorkerConfig
from tokq.queue.wire import encode_body
from tokq.workers.budget import MAX_SIZES, STEP, TIMINGS_PER_SIZE, default_budget, fit_budget


def linear_ms(fixed_ms: float, ms_per_token: float, first_slowed_ms: float = 0.0):
    """A forward time model; ``calls`` gets the sizes timed, once per size (each is timed
    TIMINGS_PER_SIZE times); ``first_slowed_ms`` slows each size's first timing (noise)."""
    calls, timed = [], []

    def time_forward_ms(num_tokens: int) -> float:
        timed.append(num_tokens)
        if len(timed) % TIMINGS_PER_SIZE == 1:
            calls.append(num_tokens)
            return fixed_ms + ms_per_token * num_tokens + first_slowed_ms
        return fixed_ms + ms_per_token * num_tokens
    return time_forward_ms, calls


def test_a_default_within_the_goal_is_kept_after_one_timing():
    timed, calls = linear_ms(5.0, 0.15)  # 1,024 tokens: 159 ms
    fit = fit_budget(timed, 1024, 250.0)
    assert (fit.budget, calls, fit.fits) == (1024, [1024], True)
    assert "within the 250 ms" in fit.describe()


@pytest.mark.parametrize("fixed_ms,ms_per_token", [(0.0, 0.65), (14.0, 0.63), (60.0, 0.9), (2.0, 1.5)])
def test_a_default_over_the_goal_is_cut_to_the_largest_step_that_fits(fixed_ms, ms_per_token):
    timed, calls = linear_ms(fixed_ms, ms_per_token)
    fit = fit_budget(timed, 1024, 250.0)
    forward = lambda n: fixed_ms + ms_per_token * n  # noqa: E731
    assert fit.fits and forward(fit.budget) <= 250.0 and fit.budget % STEP == 0
    # Not cut far past the goal: the largest fitting step is at most two steps above it
    # (MARGIN's 10% aims under the ceiling).
    largest = max(n for n in range(STEP, 1025, STEP) if forward(n) <= 250.0)
    assert largest - 2 * STEP <= fit.budget <= largest
    assert calls[0] == 1024 and calls == sorted(calls, reverse=True) and len(calls) <= MAX_SIZES
    assert fit.timings == tuple((n, forward(n)) for n in calls)
    assert f"budget 1024 -> {fit.budget} tokens" in fit.describe() and "not shown to fit" not in fit.describe()


def test_an_unreachable_goal_stops_at_the_smallest_step_or_after_max_timings():
    timed, calls = linear_ms(400.0, 0.1)  # even one token is over 250 ms
    fit = fit_budget(timed, 1024, 250.0)
    assert len(calls) == MAX_SIZES and not fit.fits and fit.budget < calls[-1]
    assert "not shown to fit" in fit.describe()
    timed, calls = linear_ms(400.0, 0.1)
    fit = fit_budget(timed, 128, 250.0)  # 128 -> 64, the floor: timed there, then it stops
    assert (fit.budget, calls, fit.fits) == (STEP, [128, STEP], False)
    assert "not shown to fit" in fit.describe()
    timed, calls = linear_ms(400.0, 0.1)
    fit = fit_budget(timed, STEP, 250.0)  # already the smallest
    assert (fit.budget, calls, fit.fits) == (STEP, [STEP], False)
    assert "over the 250 ms" in fit.describe() and "out of reach" in fit.describe()
    with pytest.raises(ValueError):
        fit_budget(timed, 1024, 0.0)


def test_a_slowed_timing_does_not_cut_the_budget_further():
    """Each size's first timing 300 ms slower (a neighbour's burst): the faster one counts."""
    quiet = fit_budget(linear_ms(10.0, 0.65)[0], 1024, 250.0)
    noisy = fit_budget(linear_ms(10.0, 0.65, first_slowed_ms=300.0)[0], 1024, 250.0)
    assert noisy == quiet and quiet.budget < 1024


def test_each_device_has_its_default():
    assert default_budget("cpu") == 1024 and default_budget("cuda") == 4096 and default_budget("mps") == 1024


# -- a real worker -------------------------------------------------------------------------------

pytest_slow = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    from tokq.workers.engine import Engine

    return Engine.load(None, device="cpu", name=QUEUE)


async def _start(q, engine, config: WorkerConfig, worker_id: str):
    from tokq.workers.worker import Worker

    worker = Worker(engine, q, config, QueueConfig(), worker_id=worker_id)
    run = asyncio.create_task(worker.run())
    deadline = time.monotonic() + 120
    while (status := await q.redis.get(q.keys.heartbeat(worker_id))) is None:
        assert time.monotonic() < deadline and not run.done(), "no heartbeat"
        await asyncio.sleep(0.05)
    return worker, run, json.loads(status)


async def _answer_one(q, client, request_id: str) -> None:
    ids = np.array([101, 7592, 2088, 102])
    await client.enqueue(request_id, [(len(ids), encode_body(ids))], timeout_ms=60_000,
                         notice_channel=client.keys.notice_channel("test"))
    deadline = time.monotonic() + 60
    while await q.redis.hlen(q.keys.reply(request_id)) < 4:  # the item + n, ch, t
        assert time.monotonic() < deadline, "no answer"
        await asyncio.sleep(0.02)


@pytest_slow
async def test_a_worker_cuts_its_default_to_an_unreachable_goal_and_still_serves(redis_url, engine, caplog):
    name = engine.info.queue_name
    caplog.set_level(logging.INFO, logger="tokq.worker")
    async with open_queue(redis_url, queue=name) as q, open_queue(redis_url, queue=name) as client:
        worker, run, status = await _start(q, engine, WorkerConfig(latency_goal_ms=1), "fit-cut")
        assert status["budget_source"] == "fitted" and STEP <= status["token_budget"] < default_budget("cpu")
        assert status["token_budget"] == worker.budget.tokens and status["token_budget"] % STEP == 0
        # The log says what was chosen and why, as a warning: the goal was not reached.
        fit_lines = [r for r in caplog.records if r.name == "tokq.worker" and "p99 goal 1 ms" in r.getMessage()]
        assert len(fit_lines) == 1 and fit_lines[0].levelno == logging.WARNING
        assert f"budget {default_budget('cpu')} -> {status['token_budget']} tokens" in fit_lines[0].getMessage()
        assert "not shown to fit" in fit_lines[0].getMessage()
        await _answer_one(q, client, "after-fit")
        worker.stop()
        await asyncio.wait_for(run, 30)


@pytest_slow
@pytest.mark.parametrize("config,source,budget", [
    (WorkerConfig(latency_goal_ms=86_400_000), "default", 1024),  # a day: every forward fits
    (WorkerConfig(latency_goal_ms=0), "default", 1024),  # 0: no fitting
    (WorkerConfig(latency_goal_ms=1, token_budget=300), "set", 300),  # set: never cut
], ids=["fits", "off", "set"])
async def test_a_default_that_fits_or_a_set_budget_is_kept(redis_url, engine, config, source, budget):
    name = engine.info.queue_name
    async with open_queue(redis_url, queue=name) as q:
        worker, run, status = await _start(q, engine, config, f"fit-{source}")
        assert (status["budget_source"], status["token_budget"]) == (source, budget)
        worker.stop()
        await asyncio.wait_for(run, 30)


@pytest_slow
async def test_a_published_budget_wins_over_fitting(redis_url, engine):
    name = engine.info.queue_name
    async with open_queue(redis_url, queue=name) as q:
        await q.set_budget(200)
        try:
            worker, run, status = await _start(q, engine, WorkerConfig(latency_goal_ms=1), "fit-published")
            assert (status["budget_source"], status["token_budget"]) == ("published", 200)
            worker.stop()
            await asyncio.wait_for(run, 30)
        finally:
            await q.redis.delete(q.keys.budget)


@pytest.mark.parametrize("value", [b"128.0", b"abc", b"-5", b"0", b"99999999999", b" 12", b"", b"1" * 5000])
def test_what_is_not_a_budget_reads_as_none_with_one_warning(value, caplog):
    from tokq.queue.shard import MAX_TOKEN_BUDGET, budget_from

    caplog.set_level(logging.WARNING, logger="tokq.queue.shard")
    assert budget_from(value, f"k-{value!r}") is None and budget_from(value, f"k-{value!r}") is None
    assert len([r for r in caplog.records if "not a token budget" in r.getMessage()]) == 1
    assert budget_from(b"128") == 128 and budget_from(str(MAX_TOKEN_BUDGET)) == MAX_TOKEN_BUDGET
    with pytest.raises(Exception, match="token_budget"):  # the same bound as --token-budget's
        WorkerConfig(token_budget=MAX_TOKEN_BUDGET + 1)


@pytest_slow
async def test_a_worker_ignores_what_is_not_a_budget_at_start_and_later(redis_url, engine):
    """A value set by hand that is not a budget crashed a starting worker (128.0), or was taken
    (99999999999, a warm-up of that many tokens); a running worker drops it as withdrawn."""
    name = engine.info.queue_name
    async with open_queue(redis_url, queue=name) as q:
        await q.redis.set(q.keys.budget, b"128.0")
        try:
            worker, run, status = await _start(q, engine, WorkerConfig(latency_goal_ms=0), "not-a-budget")
            assert (status["budget_source"], status["token_budget"]) == ("default", 1024)
            await q.set_budget(200)
            await _await_budget(q, "not-a-budget", ("published", 200))
            await q.redis.set(q.keys.budget, b"99999999999")
            await _await_budget(q, "not-a-budget", ("default", 1024))
            worker.stop()
            await asyncio.wait_for(run, 30)
        finally:
            await q.redis.delete(q.keys.budget)


@pytest_slow
def test_the_service_bench_reports_the_budget_tokq_ups_worker_chose(monkeypatch):
    """`tokq bench service`'s "tokq up defaults" system is named, and its forward timed, at the
    budget its worker serves at, read from the worker's heartbeat."""
    from tokq.profiling.bench.service.cli import system_specs
    from tokq.profiling.bench.service.systems import start_system

    monkeypatch.setenv("TOKQ_LATENCY_GOAL_MS", "1")  # `tokq up` passes it on: the worker cuts
    (spec,) = system_specs(["tokq-defaults"], budgets=[1024], profiled_budget=None, padded_max_batch=32,
                           padded_max_wait_ms=10.0)
    assert spec.token_budget == 0 and spec.label() == "tokq (`tokq up` defaults: its own budget, dtype auto)"
    system = start_system(spec, threads=1)
    try:
        assert system.budget_source == "fitted" and STEP <= system.token_budget < default_budget("cpu")
        assert spec.label(system.token_budget, system.budget_source) == (
            f"tokq (`tokq up` defaults: budget {system.token_budget}, fitted at start, dtype auto)")
    finally:
        system.close()


@pytest_slow
async def test_the_worker_fits_to_half_the_goal_and_a_budget_published_later_takes_over(redis_url, engine,
                                                                                       monkeypatch):
    """The engine's forward modelled (0.5 ms a token: 1,024 tokens 512 ms) under a 600 ms goal:
    a forward may take 300 ms, so 1,024 is cut (were the whole goal allowed, it would be kept);
    then a budget published equal to the fitted one is taken as published, and a new value
    published later replaces it."""
    monkeypatch.setattr(engine, "warmup", lambda num_tokens: time.sleep(num_tokens * 0.0005))
    name = engine.info.queue_name
    async with open_queue(redis_url, queue=name) as q:
        worker, run, status = await _start(q, engine, WorkerConfig(latency_goal_ms=600, heartbeat_ms=100),
                                           "fit-model")
        assert status["budget_source"] == "fitted" and 256 <= status["token_budget"] <= 512
        await q.set_budget(status["token_budget"])
        deadline = time.monotonic() + 10
        while json.loads(await q.redis.get(q.keys.heartbeat("fit-model")))["budget_source"] != "published":
            assert time.monotonic() < deadline, "the published budget was not taken"
            await asyncio.sleep(0.05)
        # and a new value, published while it runs (tokq profile --apply again), replaces it
        new_budget = status["token_budget"] - 64
        await q.set_budget(new_budget)
        deadline = time.monotonic() + 10
        while json.loads(await q.redis.get(q.keys.heartbeat("fit-model")))["token_budget"] != new_budget:
            assert time.monotonic() < deadline, "the newly published budget was not taken"
            await asyncio.sleep(0.05)
        assert worker.budget.tokens == new_budget
        # withdrawn: back to what it served before, as a worker started now would
        await q.redis.delete(q.keys.budget)
        await _await_budget(q, "fit-model", ("fitted", status["token_budget"]))
        worker.stop()
        await asyncio.wait_for(run, 30)


async def _await_budget(q, worker_id: str, expected: tuple[str, int]) -> None:
    deadline = time.monotonic() + 10
    while True:
        beat = json.loads(await q.redis.get(q.keys.heartbeat(worker_id)))
        if (beat["budget_source"], beat["token_budget"]) == expected:
            return
        assert time.monotonic() < deadline, f"{beat['budget_source']} {beat['token_budget']}, not {expected}"
        await asyncio.sleep(0.05)


@pytest_slow
@pytest.mark.parametrize("withdraw", ["delete", "zero"])
async def test_a_worker_started_on_a_published_budget_fits_its_default_once_that_is_withdrawn(
        redis_url, engine, monkeypatch, withdraw):
    """It never fitted (the published budget won at start); withdrawn, it serves the default, then
    fits it while idle, to what a worker started without a published budget chooses."""
    monkeypatch.setattr(engine, "warmup", lambda num_tokens: time.sleep(num_tokens * 0.0005))
    name = engine.info.queue_name
    async with open_queue(redis_url, queue=name) as q:
        fresh, run, status = await _start(q, engine, WorkerConfig(latency_goal_ms=600), "fit-fresh")
        fresh.stop()
        await asyncio.wait_for(run, 30)
        assert status["budget_source"] == "fitted"
        await q.set_budget(200)
        try:
            worker, run, status = await _start(q, engine, WorkerConfig(latency_goal_ms=600, heartbeat_ms=100),
                                               "fit-withdrawn")
            assert (status["budget_source"], status["token_budget"]) == ("published", 200)
            if withdraw == "delete":
                await q.redis.delete(q.keys.budget)
            else:  # not a budget: `tokq profile --apply` never writes it, a hand-made SET could
                await q.redis.set(q.keys.budget, 0)
            await _await_budget(q, "fit-withdrawn", ("fitted", fresh.budget.tokens))
            await _answer_one(q, q, "after-withdrawal")
            worker.stop()
            await asyncio.wait_for(run, 30)
        finally:
            await q.redis.delete(q.keys.budget)


@pytest_slow
async def test_a_worker_refitting_is_not_registered_idle(redis_url, engine, monkeypatch):
    """The refit times forwards for seconds: meanwhile a new item's one wake-up must go to a free
    worker, so the refitting one leaves the queue's idle set first."""
    fitting, members = threading.Event(), []

    def warmup(num_tokens):
        fitting.set()
        time.sleep(num_tokens * 0.0005)
    name = engine.info.queue_name
    async with open_queue(redis_url, queue=name) as q:
        await q.set_budget(200)
        try:
            worker, run, _ = await _start(q, engine, WorkerConfig(latency_goal_ms=600, heartbeat_ms=100),
                                          "refit-idle")
            while not worker.wake.idle.registered:
                await asyncio.sleep(0.02)
            assert await q.redis.smembers(q.keys.idle)  # registered while it waits
            monkeypatch.setattr(engine, "warmup", warmup)
            await q.redis.delete(q.keys.budget)
            deadline = time.monotonic() + 10
            while not fitting.is_set():
                assert time.monotonic() < deadline, "no refit"
                await asyncio.sleep(0.01)
            members = await q.redis.smembers(q.keys.idle)
            deadline = time.monotonic() + 10
            while worker.budget.source != "fitted":  # 0.5 ms a token against 300 ms a forward
                assert time.monotonic() < deadline, "the refit did not end"
                await asyncio.sleep(0.05)
            assert 256 <= worker.budget.tokens <= 512
            worker.stop()
            await asyncio.wait_for(run, 30)
        finally:
            await q.redis.delete(q.keys.budget)
    assert not members, "the refitting worker stayed in the idle set: a new item would wake it"


@pytest_slow
async def test_a_default_timed_once_is_not_timed_again_when_a_published_budget_is_withdrawn(
        redis_url, engine, monkeypatch):
    timed = []
    monkeypatch.setattr(engine, "warmup", lambda num_tokens: timed.append(num_tokens))  # every forward fits
    name = engine.info.queue_name
    async with open_queue(redis_url, queue=name) as q:
        worker, run, status = await _start(q, engine, WorkerConfig(latency_goal_ms=600, heartbeat_ms=100),
                                           "timed-once")
        assert (status["budget_source"], status["token_budget"]) == ("default", 1024)
        at_start = len(timed)
        try:
            await q.set_budget(200)
            await _await_budget(q, "timed-once", ("published", 200))
            await q.redis.delete(q.keys.budget)
            await _await_budget(q, "timed-once", ("default", 1024))
            await asyncio.sleep(0.3)  # a refit would have started by now: the worker is idle
            assert len(timed) == at_start
        finally:
            await q.redis.delete(q.keys.budget)
        worker.stop()
        await asyncio.wait_for(run, 30)
