"""The large-request lane's pacing (gateway/large_lane.py): while light calls are being served, a
large request's turn keeps its slot for a rest proportional to the turn; the caller is answered at
once; with no light calls around, turns follow each other with no rest."""

from __future__ import annotations

import asyncio
import time

import pytest

from tokq.gateway import large_lane
from tokq.gateway.errors import InvalidArgument
from tokq.gateway.large_lane import LIGHT_RECENT_S, LargeLane

TURN_S = 0.05


def _turn() -> float:
    time.sleep(TURN_S)
    return time.monotonic()


def _refused() -> None:
    time.sleep(TURN_S)
    raise InvalidArgument("too long")


@pytest.fixture
def make_lane():
    lanes = []

    def make(threads: int, share: float) -> LargeLane:
        lanes.append(LargeLane(threads, share))
        return lanes[-1]
    yield make
    for lane in lanes:
        lane.close()


@pytest.fixture
def light_lately(monkeypatch):
    """A light call seen before a turn still counts as 'being served' when the turn ends, however
    late the lane's thread (nice +10) runs on a loaded machine: a 50 ms turn outlasted 0.1 s."""
    monkeypatch.setattr(large_lane, "LIGHT_RECENT_S", 60.0)


async def test_with_light_calls_around_a_turn_rests_its_slot_after_answering(make_lane, light_lately):
    lane = make_lane(1, 0.5)  # rest one second per second of turn
    lane.light_seen()
    first_done = await lane.run(_turn)
    assert lane._slots.locked()  # the caller is answered; its slot rests on
    lane.light_seen()
    started = time.monotonic()
    second_done = await lane.run(_turn)
    # the second turn started only after the first's rest: ~TURN_S after it ended
    assert second_done - TURN_S - first_done >= 0.9 * TURN_S
    assert second_done - started >= TURN_S


async def test_a_refused_request_rests_its_slot_too(make_lane, light_lately):
    lane = make_lane(1, 0.5)
    lane.light_seen()
    started = time.monotonic()
    with pytest.raises(InvalidArgument):
        await lane.run(_refused)
    assert lane._slots.locked()
    deadline = time.monotonic() + 10
    while lane._slots.locked():  # the rest lasts as long as the turn did, however long that was
        assert time.monotonic() < deadline, "the slot never came back after its rest"
        await asyncio.sleep(0.01)
    assert time.monotonic() - started >= 2 * TURN_S  # the turn, then a rest as long


async def test_without_light_calls_turns_follow_each_other(make_lane):
    lane = make_lane(1, 0.25)
    await lane.run(_turn)
    assert not lane._slots.locked()  # never seen a light call
    lane.light_seen()
    await asyncio.sleep(LIGHT_RECENT_S * 1.2)  # ...seen, but longer ago than "being served"
    await lane.run(_turn)
    assert not lane._slots.locked()


async def test_share_one_never_rests(make_lane):
    lane = make_lane(2, 1.0)
    lane.light_seen()
    await asyncio.gather(lane.run(_turn), lane.run(_turn))
    assert lane._slots._value == 2


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5])
def test_a_share_outside_0_to_1_is_refused(share):
    with pytest.raises(ValueError, match="share"):
        LargeLane(threads=1, share=share)
