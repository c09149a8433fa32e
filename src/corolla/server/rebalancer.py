"""Where a server that chose its blocks goes, and when: the I/O around server.presence.rebalancing's decisions.

    settle()   before loading: wait a short random delay, re-read the swarm, and take other blocks for free if
               another server took the same ones (`settle_move`); at most MAX_SETTLES times
    run()      the balance check every ~balance_period, and the coverage watch (every watch_period while some
               block has fewer than 5 servers, pinging up to 8 of their servers; at once when one has none); a
               positive plan waits a random stagger, re-reads and plans again, then `move()`s
    move()     OFFLINE for the old blocks (no new sessions) and a JOINING record for the target (others see it is
               taken), drain the open sessions for up to drain_timeout (none for an urgent move), then load the
               target through JOINING -> ONLINE again

The server (server.Server) keeps the state; this class only reads the swarm and calls back into it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import TYPE_CHECKING

from corolla.dht import fetch_block_servers
from corolla.dht.ping import ping
from corolla.dht.records import announce_blocks
from corolla.protocol.errors import PeerUnavailable, ProtocolError
from corolla.protocol.messages import ServerInfo, ServerState
from corolla.server.presence import rebalancing
from corolla.server.presence.announcer import Announcer
from corolla.server.presence.rebalancing import Move
from corolla.server.presence.silence import Silence

if TYPE_CHECKING:
    from corolla.server.compute.worker import ComputeWorker
    from corolla.server.server import Server

logger = logging.getLogger(__name__)

MAX_SETTLES = 3  # re-choices before loading, at most
DRAIN_POLL = 0.5  # seconds between looks at the sessions still open while draining
PING_TIMEOUT = 2.0  # seconds a server of a thinly served block has to answer the watch's ping


class Rebalancer:
    def __init__(self, server: Server, announcer: Announcer, worker: ComputeWorker):
        self.server = server
        self.announcer = announcer
        self.worker = worker
        self.config = server.config
        self.last_move = time.monotonic()
        self.rng = random.Random()
        self.silence = Silence()  # the watch's pings: who counts as gone

    # ------------------------------------------------------------------ reading the swarm
    async def _read(self) -> list[dict[str, ServerInfo]]:
        server = self.server
        assert server.node is not None
        return await fetch_block_servers(server.node.dht, server.prefix, range(server.num_model_blocks))

    def _current(self) -> tuple[int, int]:
        return self.server.start_block, self.server.end_block

    def _share(self) -> float:
        return rebalancing.block_share(self.server.throughput, *self._current())

    # ------------------------------------------------------------------ before loading
    async def settle(self) -> None:
        """Before loading the chosen blocks (announced JOINING): move for free if another server took them too."""
        server, me = self.server, self._me()
        for _ in range(MAX_SETTLES):
            await asyncio.sleep(self.rng.uniform(0.0, self.config.settle_delay))
            try:
                view = await self._read()
            except Exception as e:  # the DHT may be briefly unreachable: load what we chose
                logger.warning("settle: could not read the swarm: %s", e)
                return
            start, end = current = self._current()
            joining = {peer: (info.start_block, info.end_block,
                              rebalancing.block_share(info.throughput, info.start_block, info.end_block))
                       for by_peer in view[start:end] for peer, info in by_peer.items()
                       if peer != me and info.state == ServerState.JOINING}
            capacity = rebalancing.swarm_capacity(view, me)
            target = rebalancing.settle_move(me, current, self._share(), capacity, joining,
                                             self.config.balance_quality)
            if target is None:
                return
            logger.info("settle: blocks %d:%d are being taken by %s too; taking %d:%d instead",
                        *current, ",".join(sorted(joining)) or "others", *target)
            server.start_block, server.end_block = target
            await self.announcer.announce()  # JOINING on the new blocks

    def _me(self) -> str:
        assert self.server.node is not None
        return self.server.node.peer_id

    # ------------------------------------------------------------------ while serving
    async def run(self) -> None:
        """Balance checks and the coverage watch, until cancelled. A move that fails stops the server.

        The watch pings the servers of thinly served blocks every watch_period and re-reads the swarm only every
        rebalancing.WATCH_READS-th time, or at once when one of them was found gone (a read of every block costs far
        more than a few pings), once: a dead server's record stays in the swarm until it expires (ServerConfig
        .expiration), and every watching server reading every block each round meanwhile overloaded the DHT of a
        48-server swarm on one machine until live servers' pings timed out too."""
        next_check = time.monotonic() + rebalancing.check_delay(self.rng, self.config.balance_period)
        view: list[dict[str, ServerInfo]] | None = None
        counted: set[str] = set()  # the servers found gone that the view at hand was read after
        ticks = 0
        while True:
            watching = view is not None and rebalancing.needs_watch(rebalancing.holder_counts(view))
            now = time.monotonic()
            await asyncio.sleep(max(0.0, (min(next_check, now + self.config.watch_period) if watching
                                          else next_check) - now))
            due = time.monotonic() >= next_check
            ticks += 1
            try:
                gone: set[str] = set()
                if watching and view is not None:
                    gone = await self._gone(view)
                if view is None or due or gone - counted or ticks % rebalancing.WATCH_READS == 0:
                    view = await self._read()
                    if not watching and rebalancing.needs_watch(rebalancing.holder_counts(view)):
                        gone = await self._gone(view)
                counted = gone
            except Exception as e:  # the DHT may be briefly unreachable; check again next period
                logger.warning("rebalancing check failed: %s", e)
                continue
            capacity = rebalancing.swarm_capacity(view, self._me(), gone)
            if due:
                next_check = time.monotonic() + rebalancing.check_delay(self.rng, self.config.balance_period)
            if not due and not rebalancing.uncovered(rebalancing.with_own(capacity, self._current(), self._share())):
                continue
            move = await self._decide(capacity)
            if move is None:
                continue
            try:
                await self.move(move)
            except Exception:  # we hold no blocks now: better to exit than to linger OFFLINE
                logger.exception("could not move to blocks %d:%d; stopping", *move.target)
                self.server.stop()
                return
            view = None

    async def _gone(self, view: list[dict[str, ServerInfo]]) -> set[str]:
        """The servers of thinly served blocks (rebalancing.to_check) that have stopped answering pings: silent
        for a while, not merely once (server.presence.silence)."""
        server = self.server
        assert server.node is not None
        peers = rebalancing.to_check(view, self._me())
        maddrs = {peer: info.maddrs for by_peer in view for peer, info in by_peer.items()}

        async def dead(peer: str) -> bool:
            try:
                await ping(server.node, peer, maddrs.get(peer, ()), connect_timeout=PING_TIMEOUT, timeout=PING_TIMEOUT)
            except PeerUnavailable:
                return True
            except ProtocolError:  # it answered, oddly: it is there
                pass
            return False

        answers = await asyncio.gather(*(dead(peer) for peer in peers))
        silent = {peer for peer, is_dead in zip(peers, answers) if is_dead}
        gone = self.silence.round(set(peers) - silent, silent, time.monotonic())
        if gone:
            logger.info("rebalance.watch: %s no longer answer; their blocks count without them",
                        ",".join(sorted(gone)))
        elif silent:
            logger.debug("rebalance.watch: %d of %d pinged did not answer (not counted yet: silence.py)",
                         len(silent), len(peers))
        return gone

    def _plan(self, capacity: list[float]) -> Move | None:
        move = rebalancing.plan_move(self._current(), self._share(), capacity, self.config.balance_quality,
                                     time.monotonic() - self.last_move, self.config.move_cooldown)
        logger.debug("rebalance.check blocks=%d:%d capacity=%s move=%s", *self._current(),
                     [round(c, 2) for c in capacity], move)
        return move

    async def _decide(self, capacity: list[float]) -> Move | None:
        """A move planned twice: now, and after a random stagger on a fresh read (another server may have moved)."""
        move = self._plan(capacity)
        if move is None:
            return None
        await asyncio.sleep(self.rng.uniform(0.0, self.config.move_stagger / (10.0 if move.urgent else 1.0)))
        view = await self._read()
        gone = await self._gone(view) if rebalancing.needs_watch(rebalancing.holder_counts(view)) else set()
        return self._plan(rebalancing.swarm_capacity(view, self._me(), gone))

    async def move(self, move: Move) -> None:
        """Leave the current blocks (draining open sessions), then serve `move.target`."""
        server = self.server
        assert server.node is not None and server.handler is not None
        current = self._current()
        logger.info("rebalancing: moving from blocks %d:%d to %d:%d%s", *current, *move.target,
                    " (a block has no server)" if move.urgent else "")
        self.last_move = time.monotonic()
        await server.stop_taking_sessions(self.announcer)  # OFFLINE for the old blocks
        reserve = server.server_info().model_copy(update={"state": ServerState.JOINING,
                                                          "start_block": move.target[0],
                                                          "end_block": move.target[1]})
        try:  # others see the target taken while we drain (the record is replaced once we load it)
            await announce_blocks(server.node.dht, server.prefix, server.node.peer_id, reserve,
                                  self.config.expiration)
        except Exception as e:
            logger.warning("could not announce the target blocks: %s", e)
        deadline = time.monotonic() + rebalancing.drain_seconds(move, self.config.drain_timeout)
        while server.handler.sessions and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL)
        await server.end_sessions()
        # drop the old blocks before loading the new ones: both may not fit in memory at once. Until the new
        # handler is registered, streams to us fail at once, and clients take them elsewhere.
        await server.handler.unregister(server.node.p2p)
        server.handler = server.stack = server.allocator = None
        server.start_block, server.end_block = move.target
        await server.serve_blocks(self.announcer, self.worker)
