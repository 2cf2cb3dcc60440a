"""`tokq bench queue` and `tokq bench shards`, each run at its smallest size."""

from __future__ import annotations

import pytest

from tokq.profiling.bench.queue import BLOCK as QUEUE, queue_command
from tokq.profiling.bench.shards import BLOCK as SHARDS, shards_command


def test_queue(bench):
    args = ["--num-claims", "20", "--rounds", "1"]
    text = bench(queue_command, args, QUEUE)
    assert f"Command: `tokq bench queue {' '.join(args)} --results-md" in text
    assert "| claim, Redis time |" in text and "strict FIFO (look-ahead 0): 0.9" in text


@pytest.mark.slow
def test_shards(bench):
    text = bench(shards_command, ["--shards", "1,2", "--procs", "1", "--seconds", "0.2", "--rounds", "1"], SHARDS)
    assert "    tokq bench shards --shards 1,2 --procs 1 --seconds 0.2 --rounds 1 --results-md" in text
    assert "| 1 |" in text and "| 2 |" in text and "### Estimate: 1,000 GPUs" in text
