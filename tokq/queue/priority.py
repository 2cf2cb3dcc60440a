"""The priority classes of queued work: one place for their names (the gateway, client and
queue all use these).

- ``interactive``: live queries, latency-bound; the light and heavy lanes (tokq/queue/claim_rule.py).
- ``batch``: bulk indexing, throughput-bound; its own lane per shard, claimed in the room
  interactive work leaves, with a share of each batch once its head has waited too long.
"""

from __future__ import annotations

from typing import Literal

Priority = Literal["interactive", "batch"]
PRIORITIES: tuple[str, ...] = ("interactive", "batch")
DEFAULT_PRIORITY: Priority = "interactive"


def check_priority(priority: str) -> str:
    """``priority`` if it names a class, else ValueError."""
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}; got {priority!r}")
    return priority
