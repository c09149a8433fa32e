"""A server's shutdown cannot hang on a background task whose cancellation was lost (corolla.tasks.cancel_and_wait).

Seen at scale (bench/bench_swarm_scale.py: 48 servers on 2 cores, load above 100): one server never exited after
SIGTERM; its rebalancer, cancelled in the middle of a DHT read, went on with its loop, and the shutdown waited for it
forever with an unbounded gather."""

from __future__ import annotations

import asyncio
import time

from corolla.tasks import cancel_and_wait


async def _loses_first_cancel(log: list[str]) -> None:
    """A loop that swallows one cancellation (as a lost cancel in a race does), then behaves."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        log.append("first cancel lost")
    while True:
        await asyncio.sleep(0.01)


async def _ignores_cancels(until: asyncio.Event) -> None:
    """Deaf to cancellation until `until` is set (then the next cancel ends it)."""
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if until.is_set():
                raise


async def _fails() -> None:
    raise RuntimeError("a background task that failed earlier")


def test_tasks_that_end_when_cancelled_end_at_once():
    async def main():
        tasks = [asyncio.create_task(asyncio.sleep(3600)), asyncio.create_task(_fails())]
        await asyncio.sleep(0)
        begin = time.monotonic()
        stuck = await cancel_and_wait(tasks, timeout=5.0)
        return stuck, time.monotonic() - begin, tasks

    stuck, elapsed, tasks = asyncio.run(main())
    assert stuck == [] and elapsed < 1.0
    assert all(task.done() for task in tasks)


def test_a_lost_cancellation_is_repeated_and_the_wait_is_bounded():
    async def main():
        log: list[str] = []
        hear = asyncio.Event()
        lost = asyncio.create_task(_loses_first_cancel(log), name="rebalancer")
        deaf = asyncio.create_task(_ignores_cancels(hear), name="deaf")
        await asyncio.sleep(0)
        begin = time.monotonic()
        stuck = await cancel_and_wait([lost, deaf], timeout=0.3)
        elapsed = time.monotonic() - begin
        hear.set()
        deaf.cancel()
        await asyncio.gather(deaf, return_exceptions=True)
        return log, lost.cancelled(), [task.get_name() for task in stuck], elapsed

    log, lost_cancelled, stuck, elapsed = asyncio.run(main())
    assert log == ["first cancel lost"] and lost_cancelled  # the second cancel ended it
    assert stuck == ["deaf"]  # reported, not waited for
    assert elapsed < 2.0
