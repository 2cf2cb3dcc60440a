"""The batch-claim rule in plain Python: the reference ``lua/claim.lua`` must agree with.

Kept beside the queue client so the rule can be read, reasoned about and property-tested
(``tests/queue/test_claim_rule_lua_matches_python.py`` runs both on random queues) without reading Lua.

Two lanes: ``pending`` (light) holds requests of at most ``QueueConfig.light_tokens`` tokens,
``heavy`` the larger ones and every redone item. Within a lane: FIFO, bounded lookahead.

- ``both`` (the usual claim): the light lane first, within half the budget while heavy work
  waits (less when the heavy head needs the room); then the heavy lane, its head always; then
  the light lane again with any room left. Each lane with work gets an item per batch.
- ``light`` (pre-empting, run nested in a heavy forward): the whole light lane when it fits
  the budget; else nothing (``backlog``): a backlog goes in full batches, not small nested ones.
- ``heavy`` (the next batch beside a heavy forward): the heavy lane alone while the light lane
  holds at most ``preempt_tokens`` (light-only claims take it); past that, the light lane first
  up to the whole budget, then heavy work that fits. The claim after a batch that is not heavy
  is ``both``, so heavy work still moves at least every other claim.

Each plan says why the batch stopped growing (``ClaimPlan.stop``, one of ``STOP_REASONS``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from tokq.queue.wire import Entry

Lanes = Literal["both", "light", "heavy"]  # which lanes a claim reads (see the module doc)
DEADLINE_EXCEEDED = b"-DEADLINE_EXCEEDED:deadline passed while queued"
# Why a claim's batch stopped growing: the budget was reached or a light entry did not fit;
# a heavy-lane entry did not fit; `lookahead` entries were passed over and one
# more did not fit; the lanes it read ran out; a redo to isolate went alone or ended the batch;
# max_drop dead entries were dropped; a light-only claim took the whole light lane; a heavy-only
# claim emptied the heavy lane, light work left to light-only claims; a light-only claim
# refused a light lane longer than its budget (no batch).
STOP_REASONS = ("full", "heavy_item", "lookahead", "dry", "isolated", "dropped", "preempt",
                "heavy_only", "backlog")


@dataclass(frozen=True)
class ClaimPlan:
    taken: tuple[Entry, ...]  # the batch: light-lane entries, then heavy-lane ones
    expired: tuple[Entry, ...]  # dropped: deadline passed (answered with DEADLINE_EXCEEDED)
    orphaned: tuple[Entry, ...]  # dropped: the request's reply key is gone
    skipped: tuple[Entry, ...]  # light lane: passed over; they stay at its head, in order
    num_scanned: int  # light-lane head entries consumed (taken + dropped + skipped)
    heavy_skipped: tuple[Entry, ...] = ()  # the same for the heavy lane
    heavy_scanned: int = 0
    num_heavy: int = 0  # entries of `taken` from the heavy lane (the last ones)
    stop: str = "dry"  # why the batch stopped growing: one of STOP_REASONS

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
    """Tokens the light lane may fill before the heavy lane: all of the budget when no heavy
    work waits, else at most half, and no more than leaves room for the heavy lane's head (so
    it goes in this batch). Room the heavy lane leaves goes back to the light lane."""
    if heavy_head is None:
        return token_budget
    return max(0, min(token_budget // 2, token_budget - heavy_head.num_tokens))


def preempt_budget(token_budget: int, light_tokens: int) -> int:
    """The budget of a light-only claim, and the size past which a batch is *heavy* (worth
    pre-empting): at least one light request, at most an eighth of the full budget, so the
    nested forward is short beside the one it interrupts."""
    return max(1, min(token_budget, max(light_tokens, token_budget // 8)))


def is_heavy_batch(token_counts: Sequence[int], num_heavy: int, preempt_tokens: int) -> bool:
    """A batch worth pre-empting: more tokens than a light-only claim, at least half of them
    from the heavy lane (``token_counts``: its entries' tokens, the heavy lane's last). A batch
    of mostly light work is not pre-empted: light work arriving meanwhile waits for the next
    full batch."""
    total = sum(token_counts)
    heavy = sum(token_counts[len(token_counts) - num_heavy:]) if num_heavy > 0 else 0
    return total > preempt_tokens and 2 * heavy >= total


def lane_exceeds(lane: Sequence[Entry], limit: int) -> bool:
    """The lane holds more than ``limit`` tokens, dead entries included (they go at the next
    full claim)."""
    total = 0
    for entry in lane:
        total += entry.num_tokens
        if total > limit:
            return True
    return False


def plan_claim(pending: Sequence[Entry], heavy: Sequence[Entry] = (), *, now_ms: int,
               token_budget: int, lookahead: int, max_skip_age_ms: int, max_drop: int,
               isolate_attempt: int, is_live: Callable[[str], bool],
               lanes: Lanes = "both", preempt_tokens: int | None = None) -> ClaimPlan:
    """Decide the next batch from the heads of the light lane ``pending`` and the ``heavy``
    lane (each oldest first); ``lanes`` as in the module doc.

    A scan takes a lane's entries in order while they fit its share of ``token_budget`` (its
    first live item always, unless the lane only fills room left). An item that does not fit
    may be passed over (at most ``lookahead`` per scan) so that smaller ones behind it fill the
    batch, unless it has waited ``max_skip_age_ms``: then the scan ends and it goes first next
    time. Expired and orphaned entries are dropped, at most ``max_drop`` per claim. An item
    redone ``isolate_attempt`` times or more (``isolate_attempt_for``) is claimed alone; when
    it heads the heavy lane, a ``both`` claim reads no light entry. ``preempt_tokens``: the
    light-only claims' budget; a ``heavy`` claim reads the light lane first when it holds more
    (None or 0: never).
    """
    light_taken: list[Entry] = []
    heavy_taken: list[Entry] = []
    expired: list[Entry] = []
    orphaned: list[Entry] = []
    tokens = 0
    done = False  # an isolated item was taken, or max_drop reached: the claim ends

    def scan(lane: Sequence[Entry], share: int, in_heavy: bool,
             lane_taken: int = 0) -> tuple[list[Entry], int, str, int]:
        """Take from ``lane`` within ``share`` tokens in all (its first live item always while
        ``lane_taken`` is 0). Returns (entries passed over, entries consumed, stop, lane_taken)."""
        nonlocal tokens, done
        taken = heavy_taken if in_heavy else light_taken
        skipped: list[Entry] = []
        consumed = 0
        for entry in lane:
            if entry.deadline_ms <= now_ms:
                expired.append(entry)
            elif not is_live(entry.request_id):
                orphaned.append(entry)
            elif (light_taken or heavy_taken) and entry.attempt >= isolate_attempt:
                return skipped, consumed, "isolated", lane_taken  # goes alone: it ends the batch
            elif lane_taken == 0 or tokens + entry.num_tokens <= share:
                taken.append(entry)
                lane_taken += 1
                tokens += entry.num_tokens
                if entry.attempt >= isolate_attempt:
                    # Alone, so a poison item cannot use up its batch-mates' attempts with its own.
                    done = True
                    return skipped, consumed + 1, "isolated", lane_taken
            elif len(skipped) >= lookahead or now_ms - entry.ts_ms >= max_skip_age_ms:
                # lookahead 0: nothing is ever passed over (strict FIFO)
                stop = "lookahead" if lookahead > 0 and len(skipped) >= lookahead else (
                    "heavy_item" if in_heavy else "full")
                return skipped, consumed, stop, lane_taken
            else:
                skipped.append(entry)
            consumed += 1
            if len(expired) + len(orphaned) >= max_drop:
                done = True
                return skipped, consumed, "dropped", lane_taken
            if lane_taken > 0 and tokens >= share:
                return skipped, consumed, "full", lane_taken
        # the lane's end; entries passed over did not fit
        return skipped, consumed, ("heavy_item" if in_heavy else "full") if skipped else "dry", lane_taken

    skipped: list[Entry] = []
    num_scanned = 0
    heavy_skipped: list[Entry] = []
    heavy_scanned = 0
    stop = "dry"
    if lanes == "light":
        if lane_exceeds(pending, token_budget):
            return ClaimPlan((), (), (), (), 0, stop="backlog")
        skipped, num_scanned, stop, _ = scan(pending, token_budget, False)
        stop = "preempt" if light_taken else stop
    elif lanes == "heavy" and (not preempt_tokens or not lane_exceeds(pending, preempt_tokens)):
        heavy_skipped, heavy_scanned, stop, _ = scan(heavy, token_budget, True)
        stop = "heavy_only" if stop == "dry" and pending else stop
    elif lanes == "heavy":  # a light backlog: light first, all of the budget; heavy work that fits
        skipped, num_scanned, stop, _ = scan(pending, token_budget, False)
        if heavy and not done and tokens < token_budget:
            heavy_skipped, heavy_scanned, stop, _ = scan(heavy, token_budget, True, lane_taken=1)
    else:
        heavy_head = heavy[0] if heavy else None
        share = light_share(token_budget, heavy_head)
        capped, num_light = False, 0
        if heavy_head is None or heavy_head.attempt < isolate_attempt:
            skipped, num_scanned, stop, num_light = scan(pending, share, False)
            capped = share < token_budget and stop in ("full", "lookahead")  # stopped by its share
        if heavy and not done:
            heavy_skipped, heavy_scanned, stop, _ = scan(heavy, token_budget, True)
        if capped and not done and tokens < token_budget:
            # The room the heavy lane left goes to the light lane: entries passed over first.
            again = skipped + list(pending[num_scanned:])
            skipped2, consumed, stop, _ = scan(again, token_budget, False, num_light)
            num_scanned += max(0, consumed - len(skipped))
            skipped = skipped2 + skipped[consumed:]
    return ClaimPlan(tuple(light_taken + heavy_taken), tuple(expired), tuple(orphaned),
                     tuple(skipped), num_scanned, tuple(heavy_skipped), heavy_scanned,
                     len(heavy_taken), stop)
