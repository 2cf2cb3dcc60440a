"""The batch-claim rule in plain Python: the reference ``lua/claim.lua`` must agree with.

Kept beside the queue client so the rule can be read, reasoned about and property-tested
(``tests/queue/test_claim_rule_lua_matches_python.py`` runs both on random queues) without reading Lua.

Three lanes. Interactive work (tokq/queue/priority.py) has two: ``pending`` (light) holds requests
of at most ``QueueConfig.light_tokens`` tokens, ``heavy`` the larger ones and its redone items.
Batch-class work has one, ``batch``, its redone items included. Within a lane: FIFO, bounded
lookahead.

- ``both`` (the usual claim): the light lane first, within half the budget while heavy work
  waits (less when the heavy head needs the room); then the heavy lane, its head always; then
  the light lane again with any room left. Each lane with work gets an item per batch.
- ``light`` (pre-empting, run nested in a heavy forward): the whole light lane when it fits
  the budget; else nothing (``backlog``): a backlog goes in full batches, not small nested ones.
  Nested in a batch-class forward (``bulk_forward``, ``is_bulk_batch``) it takes what fits from
  the lane's head, as a usual scan: queries do not wait for a bulk forward to end.
  It never reads the batch lane.
- ``heavy`` (the next batch beside a heavy forward): the heavy lane alone while the light lane
  holds at most ``preempt_tokens`` (light-only claims take it); past that, the light lane first
  up to the whole budget, then heavy work that fits. The claim after a batch that is not heavy
  is ``both``, so heavy work still moves at least every other claim.

Batch-class work, in ``both`` and ``heavy`` claims, takes the room interactive work leaves: the
interactive rule above runs first, then the batch lane fills what is left of the budget (its
head goes when nothing else was taken). Once the batch lane's head has waited
``batch_starve_ms`` the batch lane is *starving*: the interactive rule runs within the budget
less ``batch_share_tokens``, and the batch lane's head goes in every claim, with more batch work
up to the budget. A starving batch head that is a redo to isolate goes alone (unless the heavy
head is one too: that goes first).

``after_isolated``: the worker's last full claim on this shard took a redo to isolate. Then no
isolated head (the heavy lane's, a starving batch lane's) goes first: the lanes are read by the
rules above, a redo to isolate ends the batch, and goes alone the claim after. So light work and
a stream of redos to isolate alternate: each waits at most one of a worker's claims.

Each plan says why the batch stopped growing (``ClaimPlan.stop``, one of ``STOP_REASONS``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from tokq.queue.wire import Entry

Lanes = Literal["both", "light", "heavy"]  # which kind of claim (see the module doc)
DEADLINE_EXCEEDED = b"-DEADLINE_EXCEEDED:deadline passed while queued"
# Why a claim's batch stopped growing: the budget was reached or a light entry did not fit;
# a heavy-lane entry did not fit; `lookahead` entries were passed over and one
# more did not fit; the lanes it read ran out; a redo to isolate went alone or ended the batch;
# max_drop dead entries were dropped; a light-only claim took the whole light lane; a heavy-only
# claim emptied the heavy lane, light work left to light-only claims; a light-only claim
# refused a light lane longer than its budget (no batch); a batch-lane entry did not fit.
# (A light-only claim nested in a batch-class forward stops as a usual scan when the lane is longer.)
STOP_REASONS = ("full", "heavy_item", "lookahead", "dry", "isolated", "dropped", "preempt",
                "heavy_only", "backlog", "batch_item")
_ITEM_STOP = {"light": "full", "heavy": "heavy_item", "batch": "batch_item"}


@dataclass(frozen=True)
class ClaimPlan:
    taken: tuple[Entry, ...]  # the batch: light-lane entries, then heavy-lane, then batch-lane ones
    expired: tuple[Entry, ...]  # dropped: deadline passed (answered with DEADLINE_EXCEEDED)
    orphaned: tuple[Entry, ...]  # dropped: the request's reply key is gone
    skipped: tuple[Entry, ...]  # light lane: passed over; they stay at its head, in order
    num_scanned: int  # light-lane head entries consumed (taken + dropped + skipped)
    heavy_skipped: tuple[Entry, ...] = ()  # the same for the heavy lane
    heavy_scanned: int = 0
    num_heavy: int = 0  # entries of `taken` from the heavy lane (after the light ones)
    stop: str = "dry"  # why the batch stopped growing: one of STOP_REASONS
    batch_skipped: tuple[Entry, ...] = ()  # the same for the batch lane
    batch_scanned: int = 0
    num_batch: int = 0  # entries of `taken` from the batch lane (the last ones)

    def remaining(self, pending: Sequence[Entry]) -> list[Entry]:
        """The light lane after the claim."""
        return list(self.skipped) + list(pending[self.num_scanned:])

    def remaining_heavy(self, heavy: Sequence[Entry]) -> list[Entry]:
        """The heavy lane after the claim."""
        return list(self.heavy_skipped) + list(heavy[self.heavy_scanned:])

    def remaining_batch(self, batch: Sequence[Entry]) -> list[Entry]:
        """The batch lane after the claim."""
        return list(self.batch_skipped) + list(batch[self.batch_scanned:])

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


def is_heavy_batch(token_counts: Sequence[int], num_heavy: int, preempt_tokens: int,
                   num_batch: int = 0) -> bool:
    """A batch worth pre-empting: more tokens than a light-only claim, at least half of them
    from the heavy or batch lanes (``token_counts``: its entries' tokens, light ones first, then
    ``num_heavy`` heavy-lane and ``num_batch`` batch-lane ones). A batch of mostly light work is
    not pre-empted: light work arriving meanwhile waits for the next full batch."""
    total = sum(token_counts)
    tail = max(0, num_heavy) + max(0, num_batch)
    heavy = sum(token_counts[len(token_counts) - tail:]) if tail > 0 else 0
    return total > preempt_tokens and 2 * heavy >= total


def is_bulk_batch(token_counts: Sequence[int], num_heavy: int, num_batch: int) -> bool:
    """A batch whose heavy part is batch-class work: more batch-lane tokens than heavy-lane ones
    (``token_counts`` as in ``is_heavy_batch``). Light-only claims nested in its forward take
    what fits (``plan_claim``'s ``bulk_forward``), and the worker does not cap their tokens."""
    num_heavy, num_batch = max(0, num_heavy), max(0, num_batch)
    if num_batch == 0:
        return False
    tail = token_counts[len(token_counts) - num_heavy - num_batch:]
    return sum(tail[num_heavy:]) > sum(tail[:num_heavy])


def batch_share_tokens(token_budget: int, batch_share: float) -> int:
    """The tokens of a claim's budget a starving batch lane may take before interactive work
    (``QueueConfig.batch_share`` of it, rounded down)."""
    return max(0, min(token_budget, int(token_budget * batch_share)))


def lane_exceeds(lane: Sequence[Entry], limit: int) -> bool:
    """The lane holds more than ``limit`` tokens, dead entries included (they go at the next
    full claim)."""
    total = 0
    for entry in lane:
        total += entry.num_tokens
        if total > limit:
            return True
    return False


def plan_claim(pending: Sequence[Entry], heavy: Sequence[Entry] = (), batch: Sequence[Entry] = (), *,
               now_ms: int, token_budget: int, lookahead: int, max_skip_age_ms: int, max_drop: int,
               isolate_attempt: int, is_live: Callable[[str], bool],
               lanes: Lanes = "both", preempt_tokens: int | None = None,
               batch_share_tokens: int = 0, batch_starve_ms: int = 0,
               after_isolated: bool = False, bulk_forward: bool = False) -> ClaimPlan:
    """Decide the next batch from the heads of the light lane ``pending``, the ``heavy`` lane
    and the ``batch`` lane (each oldest first); ``lanes`` as in the module doc.

    A scan takes a lane's entries in order while they fit its share of ``token_budget`` (its
    first live item always, unless the lane only fills room left). An item that does not fit
    may be passed over (at most ``lookahead`` per scan) so that smaller ones behind it fill the
    batch, unless it has waited ``max_skip_age_ms``: then the scan ends and it goes first next
    time (batch-lane items are passed over at any age: the starvation share bounds the batch
    head's wait). Expired and orphaned entries are dropped, at most ``max_drop`` per claim. An
    item redone ``isolate_attempt`` times or more (``isolate_attempt_for``) is claimed alone;
    when it heads the heavy lane, a ``both`` claim reads no light entry, unless ``after_isolated``
    (module doc): then it waits for this claim's light work. ``preempt_tokens``: the
    light-only claims' budget; a ``heavy`` claim reads the light lane first when it holds more
    (None or 0: never). ``batch_share_tokens`` and ``batch_starve_ms``: the batch lane's share
    of the budget once its head has waited that long (module doc). ``bulk_forward``: a ``light``
    claim nested in a batch-class forward takes what fits instead of refusing a backlog.
    """
    light_taken: list[Entry] = []
    heavy_taken: list[Entry] = []
    batch_taken: list[Entry] = []
    taken_by_lane = {"light": light_taken, "heavy": heavy_taken, "batch": batch_taken}
    expired: list[Entry] = []
    orphaned: list[Entry] = []
    tokens = 0
    done = False  # an isolated item was taken, or max_drop reached: the claim ends

    def scan(lane: Sequence[Entry], share: int, kind: str,
             lane_taken: int = 0) -> tuple[list[Entry], int, str, int]:
        """Take from ``lane`` (of ``kind``: light, heavy, batch) within ``share`` tokens in all
        (its first live item always while ``lane_taken`` is 0). Returns (entries passed over,
        entries consumed, stop, lane_taken)."""
        nonlocal tokens, done
        taken = taken_by_lane[kind]
        skipped: list[Entry] = []
        consumed = 0
        for entry in lane:
            if entry.deadline_ms <= now_ms:
                expired.append(entry)
            elif not is_live(entry.request_id):
                orphaned.append(entry)
            elif (light_taken or heavy_taken or batch_taken) and entry.attempt >= isolate_attempt:
                return skipped, consumed, "isolated", lane_taken  # goes alone: it ends the batch
            elif lane_taken == 0 or tokens + entry.num_tokens <= share:
                taken.append(entry)
                lane_taken += 1
                tokens += entry.num_tokens
                if entry.attempt >= isolate_attempt:
                    # Alone, so a poison item cannot use up its batch-mates' attempts with its own.
                    done = True
                    return skipped, consumed + 1, "isolated", lane_taken
            elif len(skipped) >= lookahead or (kind != "batch" and now_ms - entry.ts_ms >= max_skip_age_ms):
                # lookahead 0: nothing is ever passed over (strict FIFO)
                stop = "lookahead" if lookahead > 0 and len(skipped) >= lookahead else _ITEM_STOP[kind]
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
        return skipped, consumed, _ITEM_STOP[kind] if skipped else "dry", lane_taken

    skipped: list[Entry] = []
    num_scanned = 0
    heavy_skipped: list[Entry] = []
    heavy_scanned = 0
    batch_skipped: list[Entry] = []
    batch_scanned = 0
    stop = "dry"
    if lanes == "light":
        backlog = lane_exceeds(pending, token_budget)
        if backlog and not bulk_forward:
            return ClaimPlan((), (), (), (), 0, stop="backlog")
        skipped, num_scanned, stop, _ = scan(pending, token_budget, "light")
        stop = "preempt" if light_taken and not backlog else stop
        return ClaimPlan(tuple(light_taken), tuple(expired), tuple(orphaned), tuple(skipped),
                         num_scanned, stop=stop)
    heavy_head = heavy[0] if heavy else None
    heavy_isolated = heavy_head is not None and heavy_head.attempt >= isolate_attempt
    starving = bool(batch) and now_ms - batch[0].ts_ms >= batch_starve_ms
    # A starving redo to isolate goes alone, before interactive work (a heavy one first); not
    # after_isolated: light work goes first, the redo the claim after.
    batch_alone = (starving and batch[0].attempt >= isolate_attempt and not heavy_isolated
                   and not after_isolated)
    heavy_alone = heavy_isolated and not after_isolated  # a usual claim reads no light entry
    # Interactive work's budget: all of it, or what a starving batch lane's share leaves.
    room = max(0, token_budget - batch_share_tokens) if starving else token_budget
    if batch_alone:
        pass
    elif lanes == "heavy" and (not preempt_tokens or not lane_exceeds(pending, preempt_tokens)):
        heavy_skipped, heavy_scanned, stop, _ = scan(heavy, room, "heavy")
        stop = "heavy_only" if stop == "dry" and pending else stop
    elif lanes == "heavy":  # a light backlog: light first, all of the budget; heavy work that fits
        skipped, num_scanned, stop, _ = scan(pending, room, "light")
        if heavy and not done and tokens < room:
            heavy_skipped, heavy_scanned, stop, _ = scan(heavy, room, "heavy", lane_taken=1)
    else:
        share = light_share(room, heavy_head)
        capped, num_light = False, 0
        if not heavy_alone:
            skipped, num_scanned, stop, num_light = scan(pending, share, "light")
            capped = share < room and stop in ("full", "lookahead")  # stopped by its share
        if heavy and not done:
            heavy_skipped, heavy_scanned, stop, _ = scan(heavy, room, "heavy")
        if capped and not done and tokens < room:
            # The room the heavy lane left goes to the light lane: entries passed over first.
            again = skipped + list(pending[num_scanned:])
            skipped2, consumed, stop, _ = scan(again, room, "light", num_light)
            num_scanned += max(0, consumed - len(skipped))
            skipped = skipped2 + skipped[consumed:]
    if batch and not done and (starving or tokens < token_budget):
        # Batch work: its head whenever starving or nothing else was taken, then what fits.
        forced = starving or not (light_taken or heavy_taken)
        batch_skipped, batch_scanned, stop, _ = scan(batch, token_budget, "batch", 0 if forced else 1)
    return ClaimPlan(tuple(light_taken + heavy_taken + batch_taken), tuple(expired), tuple(orphaned),
                     tuple(skipped), num_scanned, tuple(heavy_skipped), heavy_scanned,
                     len(heavy_taken), stop, tuple(batch_skipped), batch_scanned, len(batch_taken))
