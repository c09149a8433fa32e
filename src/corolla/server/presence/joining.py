"""Joining the swarm at start, again when it fails for a passing reason.

A server started while its initial peers are out of reach for a moment (its host cut off, the peers restarting, a
machine so loaded that p2pd did not start in time) used to exit at once with "could not reach any initial peer".
`join_with_retries` tries JOIN_ATTEMPTS times, JOIN_RETRY_PAUSE seconds apart, when the failure is one of those
(`passing`); anything else (a bad address, a port in use, a wrong swarm key's refusal named as such) still ends the
start at the first attempt, and the last attempt's error is what the user sees.

Seen on emulated hosts (bench/bench_swarm_scale.py --hosts 8 --servers 48): of 48 servers started half a second
apart at a load average of 16, one exited at start ("failed to connect to bootstrap peers"), and servers started
on a host cut off for 30 s exited the same way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")
JOIN_ATTEMPTS = 3
JOIN_RETRY_PAUSE = 10.0  # seconds between attempts
_PASSING = ("bootstrap failed", "failed to connect to bootstrap peers", "none of the initial peers answered",
            "Daemon failed to start in")


def passing(error: BaseException) -> bool:
    """Whether a failed join may succeed if tried again a little later (the module docstring's reasons)."""
    return any(reason in str(error) for reason in _PASSING)


async def join_with_retries(join: Callable[[], Awaitable[T]], stopped: Callable[[], bool] = lambda: False,
                            attempts: int = JOIN_ATTEMPTS, pause: float = JOIN_RETRY_PAUSE) -> T:
    """`await join()`, tried again after `pause` seconds when it fails for a passing reason, up to `attempts` times
    in all, and not once `stopped()` (the server was told to stop). Raises the last failure."""
    for attempt in range(1, attempts + 1):
        try:
            return await join()
        except Exception as e:  # noqa: BLE001 (p2pd and hivemind raise assorted types; `passing` reads the text)
            if attempt == attempts or not passing(e) or stopped():
                raise
            logger.warning("could not join the swarm (%s); trying again in %.0fs (attempt %d of %d)",
                           str(e).splitlines()[0][:300], pause, attempt + 1, attempts)
            await asyncio.sleep(pause)
    raise AssertionError("unreachable")
