"""SwarmMonitor: the latest view of the swarm and its history, refreshed in the background.

It refreshes in the event loop of the DHT node it is given (a `corolla monitor` process makes its own). A process
whose event loop drives inference (`corolla api`) runs it in a `MonitorThread` instead: a DHT node and an event
loop of its own, so reading the swarm (records anyone can add to, each signature checked) never delays a step.
Web routes only read what it holds, with `current()`, from any thread or loop, so a page view never waits on the
swarm. Each refresh reads the DHT for at most half a refresh period (monitor.collect bounds the rest).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future
from typing import Sequence

from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

from corolla.dht import SwarmNode, create_swarm_node
from corolla.membership import SwarmKey
from corolla.monitor.collect import collect_state
from corolla.monitor.config import MonitorConfig
from corolla.monitor.history import History
from corolla.monitor.schema import SwarmState
from corolla.monitor.tracker import PeerTracker

logger = logging.getLogger(__name__)

MIN_READ_TIME = 0.25  # seconds of DHT reads a refresh may always spend, however short its period


class SwarmMonitor:
    """`await refresh()` once, then `run()` as a task, both in the node's loop; `current()` is what the page and
    /metrics show."""

    def __init__(self, node: SwarmNode, config: MonitorConfig):
        self.node = node
        self.config = config
        self.history = History(config.history_length)
        self.latest: SwarmState | None = None
        self.refreshes = 0  # counters for the monitor's own /metrics
        self.refresh_failures = 0
        self.last_refresh_seconds = 0.0
        self._tracker = PeerTracker()

    async def refresh(self) -> SwarmState:
        """Read the DHT and ping every server now; the new state replaces the latest and joins the history.
        Raises what the DHT raises (the previous state stays)."""
        begin = time.perf_counter()
        try:
            state = await collect_state(
                self.node, ping_timeout=self.config.ping_timeout, max_pings=self.config.max_pings,
                refresh_period=self.config.refresh_period, tracker=self._tracker,
                read_time=max(MIN_READ_TIME, self.config.refresh_period / 2),
            )
        except Exception:
            self.refresh_failures += 1
            raise
        finally:
            self.last_refresh_seconds = time.perf_counter() - begin
        self.refreshes += 1
        self.history.add(state)
        self.latest = state
        logger.debug(
            "monitor.refresh models=%d servers=%d seconds=%.2f", len(state.models),
            sum(len(m.servers) for m in state.models), self.last_refresh_seconds,
        )
        return state

    async def run(self) -> None:
        """Refresh every refresh_period seconds (counted from the start of each refresh) until cancelled."""
        while True:
            begin = time.monotonic()
            try:
                await self.refresh()
            except Exception as e:  # the DHT may be briefly unreachable: keep the last state, try again next period
                logger.warning("monitor refresh failed: %r", e)
            await asyncio.sleep(max(0.0, self.config.refresh_period - (time.monotonic() - begin)))

    def current(self, with_history: bool = True) -> SwarmState | None:
        """The latest state, with the history if asked; None before the first refresh. Safe from any thread."""
        latest = self.latest
        if latest is None:
            return None
        return latest.model_copy(update={"history": self.history.samples() if with_history else []})


async def join_swarm(initial_peers: Sequence[str], swarm_key: SwarmKey | None = None) -> SwarmNode:
    """A client-mode DHT node joined through `initial_peers` (with `swarm_key`, a member of that private swarm);
    ValueError naming them when none answers."""
    try:
        return await create_swarm_node(initial_peers, client_mode=True, swarm_key=swarm_key)
    except P2PDaemonError as e:
        raise ValueError(f"could not join the swarm through {' '.join(initial_peers)}: {e}") from e


class MonitorThread:
    """A SwarmMonitor on a client-mode DHT node and an event loop of its own, in a daemon thread.

    `start()` joins the swarm, refreshes once (a failure is logged: the monitor retries every period) and keeps
    refreshing until `stop()`. Raises what `join_swarm` raises when the swarm cannot be joined.
    """

    def __init__(self, initial_peers: Sequence[str], config: MonitorConfig, swarm_key: SwarmKey | None = None):
        self.initial_peers = list(initial_peers)
        self.config = config
        self.swarm_key = swarm_key
        self.monitor: SwarmMonitor | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="corolla-monitor", daemon=True)
        self._task: Future[None] | None = None

    def start(self, first_refresh_timeout: float = 30.0) -> SwarmMonitor:
        self._thread.start()
        try:
            node = self._call(join_swarm(self.initial_peers, self.swarm_key), timeout=120.0)
        except BaseException:
            self._stop_loop()
            raise
        self.monitor = SwarmMonitor(node, self.config)
        try:
            self._call(self.monitor.refresh(), timeout=first_refresh_timeout)
        except Exception as e:  # the swarm may be unreachable now; the monitor retries every refresh period
            logger.warning("first swarm refresh for the monitor failed: %r", e)
        self._task = asyncio.run_coroutine_threadsafe(self.monitor.run(), self._loop)
        return self.monitor

    def stop(self) -> None:
        """Stop refreshing, leave the swarm and end the thread; safe to call twice."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self.monitor is not None:
            try:
                self._call(self.monitor.node.shutdown(), timeout=30.0)
            except Exception as e:
                logger.warning("monitor node shutdown: %r", e)
            self.monitor = None
        if self._thread.is_alive():
            try:
                self._call(_cancel_others(), timeout=30.0)  # the refresh task, and what the DHT node left behind
            except Exception as e:
                logger.warning("monitor tasks did not end: %r", e)
        self._stop_loop()

    def _call(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _stop_loop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()


async def _cancel_others() -> None:
    """Cancel every task of the running loop but this one and wait for them to end."""
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
