"""tokq.tasks: Python 3.11's asyncio.wait_for (under redis-py's sends) returns the result when
a cancel lands as it arrives, and a background loop then runs on. ``raise_if_cancelled`` ends
such a loop at its next check; ``stop_tasks`` stops tasks, cancelling again after a grace."""

from __future__ import annotations

import asyncio
import random

import pytest

from tokq.tasks import GRACE_S, stop_tasks, raise_if_cancelled
from tokq.redis.connection import connect


def dropping(cancels_dropped: int | None):
    """A loop that drops its first ``cancels_dropped`` cancels (None: all of them), as a redis-py
    command does when wait_for swallows one."""
    state = {"dropped": 0}

    async def loop():
        while True:
            try:
                await asyncio.sleep(0.001)
            except asyncio.CancelledError:
                if cancels_dropped is not None and state["dropped"] >= cancels_dropped:
                    raise
                state["dropped"] += 1
                asyncio.current_task().uncancel()
    return loop, state


async def test_a_task_that_drops_cancels_is_cancelled_again_until_it_ends():
    loop, state = dropping(3)
    task = asyncio.create_task(loop())
    await asyncio.sleep(0.01)
    assert await stop_tasks([task, None], timeout_s=5) is True
    assert task.cancelled() and state["dropped"] == 3


async def test_a_clean_up_within_the_grace_is_not_cut_short():
    done = []

    async def slow_clean_up():
        try:
            await asyncio.sleep(60)
        finally:
            await asyncio.sleep(GRACE_S / 2)  # e.g. a lock released on the way out
            done.append(True)
    task = asyncio.create_task(slow_clean_up())
    await asyncio.sleep(0.01)
    assert await stop_tasks(task, timeout_s=5) is True and done == [True]


async def test_cancelled_itself_it_cancels_the_tasks_once_more_and_lets_the_cancel_through():
    loop, state = dropping(1)
    task = asyncio.create_task(loop())
    await asyncio.sleep(0.01)
    waiter = asyncio.create_task(stop_tasks(task))
    await asyncio.sleep(GRACE_S / 5)  # the first cancel was dropped; the grace is running
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await asyncio.wait([task], timeout=5)
    assert task.cancelled() and state["dropped"] == 1


async def test_a_task_that_never_ends_is_given_up_on_after_the_timeout():
    loop, state = dropping(None)
    task = asyncio.create_task(loop())
    await asyncio.sleep(0.01)
    assert await stop_tasks(task, timeout_s=GRACE_S + 0.3) is False
    assert not task.done() and state["dropped"] >= 2
    task.cancel()  # let it go: it drops this one too, so stop it the hard way
    task.get_coro().close()


async def test_failed_and_finished_tasks_are_taken_as_they_are():
    async def fail():
        raise RuntimeError("boom")
    failed, finished = asyncio.create_task(fail()), asyncio.create_task(asyncio.sleep(0))
    await asyncio.sleep(0.01)
    assert await stop_tasks([failed, finished]) is True
    assert isinstance(failed.exception(), RuntimeError) and finished.result() is None


async def test_a_dropped_cancel_is_raised_at_the_next_check():
    checked = []

    async def drops_its_cancel():
        asyncio.current_task().cancel()
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:  # dropped, as wait_for does: nothing uncancels it
            pass
        checked.append("before")
        raise_if_cancelled()
        checked.append("after")
    task = asyncio.create_task(drops_its_cancel())
    await asyncio.wait([task], timeout=5)
    assert task.cancelled() and checked == ["before"]
    raise_if_cancelled()  # this task has no cancel pending: nothing happens


async def test_redis_loops_with_the_check_end_on_one_cancel(redis_url):
    """The real case: 40 loops of GETs, each cancelled once at a random point, all end within
    seconds. Without the check a quarter or more run on (a cancel dropped by wait_for)."""
    client = connect(redis_url)

    async def poll():
        while True:
            await client.get("k")
            raise_if_cancelled()
    try:
        for _ in range(40):
            task = asyncio.create_task(poll())
            await asyncio.sleep(random.random() * 0.002)
            task.cancel()
            await asyncio.wait([task], timeout=5)
            assert task.done(), "a loop ran on after its cancel"
    finally:
        await client.aclose()
