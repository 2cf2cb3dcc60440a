"""Light work arriving in a stream during a long batch-class forward all runs nested in it
(workers/loop.py, tokq/queue/claim_rule.py ``bulk_forward``): a nested claim takes what fits
from a light lane longer than its budget, and the nested batches hold more tokens in all than
one light-only claim. In process, with a real Redis and the real bundled model; the bulk
forward lasts until the test ends it (its thread runs checkpoints meanwhile), never by timing."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from gated_engine import HEAVY_TOKENS
from gated_worker import fp32_engine, token_ids, worker_rig
from queue_support import answered_vectors, enqueue_ids, wait_for

from tokq.batch import PackedBatch
from tokq.workers.preempt import current_checkpoint

pytestmark = pytest.mark.slow

QUERY_TOKENS = 20


@pytest.fixture(scope="module")
def engine():
    return fp32_engine()


class LongBulkEngine:
    """The real engine; a heavy batch's forward waits for ``go``, then runs checkpoints (as the
    model's layers do) until ``end`` is set, so it lasts as long as the test needs. Forwards are
    logged with their depth: 2 for a batch run nested in the heavy one."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.entered = threading.Event()
        self.go = threading.Event()
        self.end = threading.Event()
        self.log: list[tuple[str, int, int]] = []
        self.depth = 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def embed(self, batch):
        self.depth += 1
        self.log.append(("start", batch.num_tokens, self.depth))
        try:
            if batch.num_tokens > HEAVY_TOKENS:
                self.entered.set()
                assert self.go.wait(60)
                checkpoint, deadline = current_checkpoint(), time.monotonic() + 60
                while not self.end.is_set() and time.monotonic() < deadline:
                    checkpoint()
                    self.end.wait(0.005)
            return self._engine.embed(batch)
        finally:
            self.depth -= 1
            self.log.append(("end", batch.num_tokens, self.depth + 1))


async def test_a_light_stream_beside_a_bulk_forward_all_runs_nested(redis_url, engine):
    slow = LongBulkEngine(engine)
    rng = np.random.default_rng(21)
    bulk_ids = [token_ids(rng, 100) for _ in range(2)]
    # 17 queries, 340 tokens: past a light-only claim's 128
    queries = {f"q{i}": [token_ids(rng, QUERY_TOKENS)] for i in range(17)}
    async with worker_rig(redis_url, engine) as rig:
        q, client = rig.q, rig.client
        worker = rig.worker(slow, "bulk")
        await rig.start(worker)

        await rig.offer_during_heavy(worker, slow.entered, ("bulk", bulk_ids), ("q0", queries["q0"]),
                                     batch_class=True)
        for i in range(1, 11):  # 200 tokens queue behind it: more than a light-only claim's budget
            await enqueue_ids(client, f"q{i}", queries[f"q{i}"])
        slow.go.set()

        async def nested(n):
            return worker.loop.preemption.nested_runs >= n
        await wait_for(lambda: nested(2), 30, "two nested batches")
        for i in range(11, 17):  # more arrive while the forward goes on
            await enqueue_ids(client, f"q{i}", queries[f"q{i}"])
        got = {rid: await answered_vectors(client, rid, 1) for rid in queries}
        assert not await q.redis.hexists(q.keys.reply("bulk"), "0")  # the bulk forward still runs
        slow.end.set()
        got["bulk"] = await answered_vectors(client, "bulk", len(bulk_ids))

        light = [(tokens, depth) for event, tokens, depth in slow.log
                 if event == "start" and tokens <= HEAVY_TOKENS]
        assert all(depth == 2 for _, depth in light)  # every light batch ran inside the bulk forward
        assert sum(tokens for tokens, _ in light) == 17 * QUERY_TOKENS
        # The second nested claim found 200 tokens queued: it took the 120 that fit, not nothing.
        assert [tokens for tokens, _ in light[:2]] == [QUERY_TOKENS, 6 * QUERY_TOKENS]
        assert slow.log[0] == ("start", sum(map(len, bulk_ids)), 1)
        assert slow.log[-1] == ("end", sum(map(len, bulk_ids)), 1)
        assert worker.loop.num_preemptions == len(light)
        for rid, seqs in (*queries.items(), ("bulk", bulk_ids)):
            np.testing.assert_allclose(got[rid], engine.embed(PackedBatch.pack(seqs)), atol=1e-5)
        stats = await q.stats()
        assert (stats.inflight_items, stats.queued_entries) == (0, 0)
        await rig.stop(worker)
        assert rig.exits == []
