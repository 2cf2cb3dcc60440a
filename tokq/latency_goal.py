"""The latency model token budgets are sized by (``tokq profile`` and a worker's own default).

A request waits for the running batch, then rides in the next, so a budget keeps a p99 goal
reachable if its forward takes at most goal / FORWARDS_PER_REQUEST (docs/internals.md).
"""

FORWARDS_PER_REQUEST = 2.0
DEFAULT_SLO_P99_MS = 500.0  # also `tokq bench service --slo-ms`'s default


def max_forward_ms(slo_p99_ms: float) -> float:
    """The longest forward of a full batch that keeps a p99 goal of ``slo_p99_ms`` reachable."""
    return slo_p99_ms / FORWARDS_PER_REQUEST
