"""Helpers shared by the CLI commands: logging set-up and running a coroutine until a signal."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")


def setup_logging(verbosity: int = 0) -> None:
    """INFO to stderr for corolla's loggers (DEBUG with -v); other libraries stay at WARNING."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    logging.getLogger("corolla").setLevel(logging.DEBUG if verbosity else logging.INFO)
    # hivemind installs its own handler on import; keep its chatter out of our output
    logging.getLogger("hivemind").setLevel(logging.ERROR)
    logging.getLogger("hivemind").propagate = False


def run_until_signal(main: Callable[[asyncio.Event], Awaitable[T]]) -> T:
    """asyncio.run(main(stop)): the first SIGINT/SIGTERM sets `stop` (graceful shutdown), a second one cancels."""

    async def runner() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        stop = asyncio.Event()

        def on_signal() -> None:
            if stop.is_set() and task is not None:
                task.cancel()
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        return await main(stop)

    return asyncio.run(runner())
