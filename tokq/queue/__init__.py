"""The Redis queue: key names (keys), the wire formats of entries and results (wire), the Lua
scripts (scripts), the claim rule's Python reference (claim_rule), one shard's client (shard), a
model's queue as S shards (sharded) and its sides: the gateways' (producer), the workers'
(consumer) and the metrics' (stats); the priority classes (priority).
"""

from tokq.queue.priority import DEFAULT_PRIORITY, PRIORITIES, Priority, check_priority

__all__ = ["DEFAULT_PRIORITY", "PRIORITIES", "Priority", "check_priority"]
