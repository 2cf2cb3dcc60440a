"""The batch-claim rule in plain Python: the reference ``lua/claim.lua`` must agree with.

Kept beside the queue client so the rule can be read, reasoned about and property-tested
(``tests/test_queue_claim_rule.py`` runs both on random queues) without reading Lua.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tokq.entry import Entry

DEADLINE_EXCEEDED = b"-DEADLINE_EXCEEDED:deadline passed while queued"


@dataclass(frozen=True)
class ClaimPlan:
    taken: tuple[Entry, ...]  # the batch, in queue order
    expired: tuple[Entry, ...]  # dropped: deadline passed (answered with DEADLINE_EXCEEDED)
    orphaned: tuple[Entry, ...]  # dropped: the request's reply key is gone
    skipped: tuple[Entry, ...]  # passed over; they stay at the head, in order
    num_scanned: int  # head entries consumed (taken + dropped + skipped)

    def remaining(self, pending: Sequence[Entry]) -> list[Entry]:
        """The queue after the claim."""
        return list(self.skipped) + list(pending[self.num_scanned:])

    @property
    def taken_tokens(self) -> int:
        return sum(e.num_tokens for e in self.taken)


def isolate_attempt_for(max_attempts: int) -> int:
    """The attempt from which a redone item is claimed alone: its third try (it failed twice),
    or its last one when fewer are allowed, so a poison item's final crash takes no batch-mate
    down with it. Items redone once (a crashed worker's whole batch) go back in full batches:
    isolating them all would turn one crash into hundreds of single-item forwards."""
    return max(1, min(2, max_attempts - 1))


def plan_claim(pending: Sequence[Entry], *, now_ms: int, token_budget: int, lookahead: int,
               max_skip_age_ms: int, max_drop: int, isolate_attempt: int,
               is_live: Callable[[str], bool]) -> ClaimPlan:
    """Decide the next batch from the head of ``pending`` (oldest first).

    FIFO up to ``token_budget`` tokens; the first live item is always taken, even alone over the
    budget. An item that does not fit may be passed over (at most ``lookahead`` of them) so
    that smaller ones behind it fill the batch, unless it has waited ``max_skip_age_ms``:
    then the batch ends and it goes first next time, so nothing starves. An item redone
    ``isolate_attempt`` times or more (see ``isolate_attempt_for``) is claimed alone.
    """
    taken: list[Entry] = []
    expired: list[Entry] = []
    orphaned: list[Entry] = []
    skipped: list[Entry] = []
    taken_tokens = 0
    num_scanned = 0
    for entry in pending:
        if entry.deadline_ms <= now_ms:
            expired.append(entry)
        elif not is_live(entry.request_id):
            orphaned.append(entry)
        elif taken and entry.attempt >= isolate_attempt:
            break  # an item that failed repeatedly goes alone (below): it ends this batch
        elif not taken or taken_tokens + entry.num_tokens <= token_budget:
            taken.append(entry)
            taken_tokens += entry.num_tokens
            if entry.attempt >= isolate_attempt:
                # Alone, so a poison item cannot use up its batch-mates' attempts with its own.
                num_scanned += 1
                break
        elif len(skipped) >= lookahead or now_ms - entry.ts_ms >= max_skip_age_ms:
            break  # lookahead 0: nothing is ever passed over (strict FIFO)
        else:
            skipped.append(entry)
        num_scanned += 1
        if taken_tokens >= token_budget or len(expired) + len(orphaned) >= max_drop:
            break
    return ClaimPlan(tuple(taken), tuple(expired), tuple(orphaned), tuple(skipped), num_scanned)
