"""The latency model token budgets are sized by (``tokq profile`` and a worker's own default).

Under load, a request that arrives while a batch runs waits for it (up to one forward), then
rides in the next batch (one forward): its latency is about two forwards of a full batch, plus
queueing and transport the goal must also hold. A deeper queue than one batch means the offered
load is above what the budget serves at all, where no budget meets a goal. So a budget keeps the
goal reachable if its forward takes at most goal / FORWARDS_PER_REQUEST.
"""

FORWARDS_PER_REQUEST = 2.0
DEFAULT_SLO_P99_MS = 500.0  # also `tokq bench service --slo-ms`'s default


def max_forward_ms(slo_p99_ms: float) -> float:
    """The longest forward of a full batch that keeps a p99 goal of ``slo_p99_ms`` reachable."""
    return slo_p99_ms / FORWARDS_PER_REQUEST
