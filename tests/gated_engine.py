"""The real engine behind gates the worker tests open (tests/worker/test_light_work_preempts_heavy_forward.py,
tests/cluster/test_worker_registers_on_every_shard.py): the order of a heavy forward and what
runs beside it is forced with events, never by timing."""

from __future__ import annotations

import threading

HEAVY_TOKENS = 128  # a batch of more is heavy (preempt_budget(512, light_tokens=128))


class GatedEngine:
    """The real engine; a heavy batch's forward (over ``gate_above`` tokens) waits for ``go``
    before it starts and for ``finish`` before it returns, and every forward's start and end is logged."""

    def __init__(self, engine, gate_above: int = HEAVY_TOKENS) -> None:
        self._engine = engine
        self.gate_above = gate_above
        self.go = threading.Event()
        self.finish = threading.Event()
        self.heavy_entered = threading.Event()
        self.log: list[tuple[str, int]] = []
        self.depth = 0  # forwards running: 2 while a light batch runs nested in a heavy one

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def embed(self, batch):
        heavy = batch.num_tokens > self.gate_above
        if heavy:
            self.heavy_entered.set()
            assert self.go.wait(60)
        self.log.append(("start", batch.num_tokens))
        self.depth += 1
        try:
            vectors = self._engine.embed(batch)
        finally:
            self.depth -= 1
        self.log.append(("end", batch.num_tokens))
        if heavy:
            assert self.finish.wait(60)
        return vectors
