"""The batch-claim rule in plain Python: the reference ``lua/claim.lua`` must agree with.

Kept beside the queue client so the rule can be read, reasoned about and property-tested
(``tests/test_queue_claim_rule.py`` runs both on random queues) without reading Lua.

A queue has two lanes (two Redis lists): ``pending`` holds requests of at most
``QueueConfig.light_tokens`` tokens (all inputs together), ``heavy`` the larger ones and every
redone item. A claim serves the light lane first, but while heavy work waits the light lane
gets at most half the budget (less when the heavy head needs more room), and each lane with
work gets at least one item per batch: a flood of heavy requests cannot starve a one-word call
(it waits for its own forward and the one in flight, or one block of it: see below), and a flood
of light ones cannot starve heavy requests. Within a lane the rule is FIFO with bounded lookahead.

A *light-only* claim (``lanes="light"``) takes light-lane entries alone, up to all of its
(small) budget: a worker running a heavy forward runs that batch nested between two steps of
its layers (workers/preempt.py), so a one-word call need not wait for the forward in flight.
Such a worker claims its next batch ``lanes="heavy"``: light work is left to its light-only
claims, so none rides in a heavy batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from tokq.queue.wire import Entry

Lanes = Literal["both", "light", "heavy"]  # which lanes a claim reads (see the module doc)
DEADLINE_EXCEEDED = b"-DEADLINE_EXCEEDED:deadline passed while queued"


@dataclass(frozen=True)
class ClaimPlan:
    taken: tuple[Entry, ...]  # the batch: light-lane entries, then heavy-lane ones, in lane order
    expired: tuple[Entry, ...]  # dropped: deadline passed (answered with DEADLINE_EXCEEDED)
    orphaned: tuple[Entry, ...]  # dropped: the request's reply key is gone
    skipped: tuple[Entry, ...]  # light lane: passed over; they stay at its head, in order
    num_scanned: int  # light-lane head entries consumed (taken + dropped + skipped)
    heavy_skipped: tuple[Entry, ...] = ()  # the same for the heavy lane
    heavy_scanned: int = 0
    num_heavy: int = 0  # entries of `taken` from the heavy lane (the last ones)

    def remaining(self, pending: Sequence[Entry]) -> list[Entry]:
        """The light lane after the claim."""
        return list(self.skipped) + list(pending[self.num_scanned:])

    def remaining_heavy(self, heavy: Sequence[Entry]) -> list[Entry]:
        """The heavy lane after the claim."""
        return list(self.heavy_skipped) + list(heavy[self.heavy_scanned:])

    @property
    def taken_tokens(self) -> int:
        return sum(e.num_tokens for e in self.taken)


def isolate_attempt_for(max_attempts: int) -> int:
    """The attempt from which a redone item is claimed alone: its third try (it failed twice),
    or its last one when fewer are allowed, so a poison item's final crash takes no batch-mate
    down with it. Items redone once (a crashed worker's whole batch) go back in full batches:
    isolating them all would turn one crash into hundreds of single-item forwards."""
    return max(1, min(2, max_attempts - 1))


def light_share(token_budget: int, heavy_head: Entry | None) -> int:
    """Tokens the light lane may fill: all of the budget when no heavy work waits, else at most
    half, and no more than leaves room for the heavy lane's head (so it goes in this batch)."""
    if heavy_head is None:
        return token_budget
    return max(0, min(token_budget // 2, token_budget - heavy_head.num_tokens))


def preempt_budget(token_budget: int, light_tokens: int) -> int:
    """The budget of a light-only claim, and the size past which a batch is *heavy* (worth
    pre-empting): at least one light request, at most an eighth of the full budget, so the
    nested forward is short beside the one it interrupts."""
    return max(1, min(token_budget, max(light_tokens, token_budget // 8)))


def plan_claim(pending: Sequence[Entry], heavy: Sequence[Entry] = (), *, now_ms: int,
               token_budget: int, lookahead: int, max_skip_age_ms: int, max_drop: int,
               isolate_attempt: int, is_live: Callable[[str], bool],
               lanes: Lanes = "both") -> ClaimPlan:
    """Decide the next batch from the heads of the light lane ``pending`` and the ``heavy``
    lane (each oldest first).

    In each lane, FIFO up to its share of ``token_budget`` tokens (the light lane: ``light_share``;
    the heavy lane: what is left); the first live item of each lane is always taken, even over
    its share. An item that does not fit may be passed over (at most ``lookahead`` of them per
    lane) so that smaller ones behind it fill the batch, unless it has waited
    ``max_skip_age_ms``: then that lane's part ends and it goes first next time, so nothing
    starves. An item redone ``isolate_attempt`` times or more (see ``isolate_attempt_for``) is
    claimed alone; when it heads the heavy lane, the light lane waits this one claim.
    ``lanes``: "light" = the light lane alone, within all of ``token_budget`` (``heavy`` is not
    read); "heavy" = the heavy lane alone; "both" = the rule above.
    """
    taken: list[Entry] = []
    expired: list[Entry] = []
    orphaned: list[Entry] = []
    done = False  # an isolated item was taken, or max_drop reached: the claim ends

    def scan(lane: Sequence[Entry], share: int) -> tuple[list[Entry], int]:
        nonlocal done
        skipped: list[Entry] = []
        lane_taken = 0
        num_scanned = 0
        tokens = sum(e.num_tokens for e in taken)
        for entry in lane:
            if entry.deadline_ms <= now_ms:
                expired.append(entry)
            elif not is_live(entry.request_id):
                orphaned.append(entry)
            elif taken and entry.attempt >= isolate_attempt:
                break  # an item that failed repeatedly goes alone (below): it ends this batch
            elif lane_taken == 0 or tokens + entry.num_tokens <= share:
                taken.append(entry)
                lane_taken += 1
                tokens += entry.num_tokens
                if entry.attempt >= isolate_attempt:
                    # Alone, so a poison item cannot use up its batch-mates' attempts with its own.
                    num_scanned += 1
                    done = True
                    break
            elif len(skipped) >= lookahead or now_ms - entry.ts_ms >= max_skip_age_ms:
                break  # lookahead 0: nothing is ever passed over (strict FIFO)
            else:
                skipped.append(entry)
            num_scanned += 1
            if len(expired) + len(orphaned) >= max_drop:
                done = True
                break
            if lane_taken > 0 and tokens >= share:
                break
        return skipped, num_scanned

    if lanes == "light":
        heavy = ()
    heavy_head = heavy[0] if heavy else None
    skipped: list[Entry] = []
    num_scanned = 0
    if lanes != "heavy" and (heavy_head is None or heavy_head.attempt < isolate_attempt):
        skipped, num_scanned = scan(pending, light_share(token_budget, heavy_head))
    heavy_skipped: list[Entry] = []
    heavy_scanned = 0
    num_light = len(taken)
    if not done:
        heavy_skipped, heavy_scanned = scan(heavy, token_budget)
    return ClaimPlan(tuple(taken), tuple(expired), tuple(orphaned), tuple(skipped), num_scanned,
                     tuple(heavy_skipped), heavy_scanned, len(taken) - num_light)
