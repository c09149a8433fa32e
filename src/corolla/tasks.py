"""Ending asyncio tasks without hanging on one whose cancellation was lost.

A task that is cancelled can go on running: `asyncio.wait_for` on Python < 3.12 swallows a cancellation that arrives
as its inner awaitable finishes, and the task then carries on with its loop. Awaiting such a task after cancelling it
hangs the caller: a server that never exited after SIGTERM (48 servers on 2 cores); a client session with a standby
whose close never returned, once, under three test workers (where it hung is not pinned down: the standby's tasks now
end through this). `cancel_and_wait` bounds the wait.
"""

from __future__ import annotations

import asyncio


async def cancel_and_wait(tasks: list[asyncio.Task], timeout: float) -> list[asyncio.Task]:
    """Cancel `tasks` and wait up to `timeout` seconds for them to end; a task still running then (its cancellation
    was lost: seen with 48 servers on 2 cores, where a server's rebalancer went on with its loop after the shutdown
    cancelled it and the server never exited after SIGTERM; where it was lost is not pinned down, `asyncio.wait_for`
    on Python < 3.12 is one known place) is cancelled once more and given another `timeout`. Returns the tasks that
    still did not end; a caller shuts down without them rather than hang."""
    for task in tasks:
        task.cancel()
    pending: set[asyncio.Task] = {task for task in tasks if not task.done()}
    for attempt in range(2):
        if not pending:
            break
        if attempt:
            for task in pending:
                task.cancel()
        _, pending = await asyncio.wait(pending, timeout=timeout)
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: no "exception was never retrieved" at exit
    return [task for task in tasks if task in pending]
