"""Who serves what: a cached view of the swarm, measured round trips, peer bans with backoff, routes on demand.

All methods run on the client's event loop.

Two kinds of failure are told apart:
- a peer that answered badly or broke a stream is *banned* with exponential backoff, but a ban never makes a
  block unservable: when only banned peers hold a block, they are used anyway (so are the common factors of failed
  push links, client.swarm.links, routed around as banned ones);
- a peer that cannot even be dialed (by a session, or by the background pings) is *unreachable*: it is skipped
  outright for at least `unreachable_ban` seconds, so a dead server whose DHT record has not expired yet costs
  one failed dial, and leads to `MissingBlocks` rather than a hang when nobody else holds its blocks. A later ping
  that gets an answer (the server is back from a network outage) lifts such a ban at once.

What servers announce about their speed is weighed against what the client measures: sessions and forward passes
report each span's time (`observe`), and routes believe an announced throughput only up to a small factor of the
measured one (client.swarm.routing, "What a server announces about itself").
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import time
from collections.abc import Collection

from corolla.client.config import ClientConfig
from corolla.client.swarm.bans import Ban, banned_peers, next_ban, retry_delay
from corolla.client.swarm.links import LinkRecord
from corolla.client.swarm.routing import (Span, find_route, measured_speed, sample_route, uncovered_blocks, usable_servers,
                                    whole_span_view, with_codec)
from corolla.dht import SwarmNode, fetch_block_servers
from corolla.dht.ping import ping, smooth
from corolla.protocol.errors import AllocationFailed, MissingBlocks, PeerUnavailable, PeerUnreachable, RemoteError
from corolla.protocol.messages import ErrorCode, ServerInfo, ServerState

logger = logging.getLogger(__name__)

# Server errors that a different server may not have; anything else (bad_request, session_full) is the caller's.
OPEN_TIMEOUT_RTTS = 20.0  # a stream to a server of known round trip gets this many round trips to open...
OPEN_TIMEOUT_FLOOR = 2.0  # ...and at least this many seconds (open_timeout)
RETRYABLE_CODES = {
    ErrorCode.TIMEOUT.value, ErrorCode.SHUTTING_DOWN.value, ErrorCode.INTERNAL.value, ErrorCode.SERVER_FULL.value,
    ErrorCode.NOT_SERVED.value, ErrorCode.PEER_LIMIT.value,  # a server past its per-peer limits: another one may not be
}


def is_retryable(error: Exception) -> bool:
    return isinstance(error, PeerUnavailable) or (isinstance(error, RemoteError) and error.code in RETRYABLE_CODES)


def _log_refresh_failure(task: asyncio.Task[None]) -> None:
    """A background re-read of the swarm failed: the view at hand stays (the next update tries again)."""
    if not task.cancelled() and task.exception() is not None:
        logger.info("re-reading the swarm in the background failed: %r", task.exception())


class SequenceManager:
    def __init__(self, node: SwarmNode, prefix: str, num_blocks: int, config: ClientConfig):
        self.node = node
        self.prefix = prefix
        self.num_blocks = num_blocks
        self.config = config
        self.block_servers: list[dict[str, ServerInfo]] = [{} for _ in range(num_blocks)]
        self.last_update = -float("inf")
        self.rtts: dict[str, float] = {}  # peer id -> smoothed round trip, seconds
        self.speeds: dict[str, float] = {}  # peer id -> smoothed measured throughput, tokens/s per block
        self._measured_at: dict[str, float] = {}
        self._bans: dict[str, Ban] = {}
        # spot checks (client.trust.spot_checks): peers caught returning wrong outputs, never routed through again
        self.distrusted: set[str] = set()
        self.links = LinkRecord()  # push links that failed with no provable culprit (client.swarm.links)
        self._stale = False  # set by invalidate(): re-read the DHT at the next update
        self._update_lock = asyncio.Lock()
        self._pings: asyncio.Task[None] | None = None
        self._refresh: asyncio.Task[None] | None = None  # a re-read of the swarm in the background (refresh_soon)
        self._probes: set[asyncio.Task[None]] = set()
        self._rng = random.Random()

    async def update(self, force: bool = False) -> None:
        """Re-read every block's servers from the DHT (at most once per update_period unless forced).

        Round trips to servers not measured within update_period are then measured: awaited (briefly) on the
        first update so the first route uses them, in the background afterwards so failover never waits on pings.
        """
        async with self._update_lock:
            if not force and not self._due():
                return
            first = self.last_update == -float("inf")
            servers = await fetch_block_servers(self.node.dht, self.prefix, range(self.num_blocks),
                                                prefer=self.rtts.keys())
            # a session's codec needs servers that take it (ServerInfo.codecs): the others do not exist for this client
            self.block_servers = with_codec(servers, self.config.compression)
            self.last_update = time.monotonic()
            self._stale = False
            logger.debug("swarm view updated: %s", [len(s) for s in self.block_servers])
        if self._pings is None or self._pings.done():
            self._pings = asyncio.create_task(self._measure_rtts())
            if first:
                await asyncio.wait({self._pings}, timeout=self.config.ping_timeout)

    def refresh_soon(self) -> None:
        """Re-read the swarm in the background if the view is due (older than update_period, or invalidated), without
        waiting for it: a failover routes on the view at hand meanwhile (a re-read over 50 ms links took 0.9 s, on the
        critical path of every failover whose view was older than update_period)."""
        if self._due() and (self._refresh is None or self._refresh.done()):
            self._refresh = asyncio.ensure_future(self.update())
            self._refresh.add_done_callback(_log_refresh_failure)

    def _due(self) -> bool:
        """Whether the view is to be re-read: older than update_period, or invalidated."""
        return self._stale or time.monotonic() - self.last_update >= self.config.update_period

    def invalidate(self) -> None:
        """Make the next `update()` re-read the DHT (a server turned out to hold other blocks than we thought)."""
        self._stale = True

    async def _measure_rtts(self) -> None:
        now = time.monotonic()
        peers = {
            peer
            for servers in self.block_servers
            for peer, info in servers.items()
            if info.state == ServerState.ONLINE
            and now - self._measured_at.get(peer, -float("inf")) > self.config.update_period
        }
        await asyncio.gather(*(self._ping(peer) for peer in sorted(peers)))

    async def _ping(self, peer_id: str) -> None:
        """Measure the round trip to `peer_id` (dht.ping, as servers measure theirs) into `rtts`; a peer that
        cannot be dialed is banned as unreachable, one that answers again has such a ban lifted."""
        try:
            sample = await ping(
                self.node,
                peer_id,
                info.maddrs if (info := self.info(peer_id)) is not None else (),
                connect_timeout=self.config.connect_timeout,
                timeout=self.config.ping_timeout,
            )
        except PeerUnavailable as e:
            logger.debug("ping to %s failed: %s", peer_id, e)
            if isinstance(e, PeerUnreachable) and peer_id not in self.banned(unreachable_only=True):
                self.ban(peer_id, unreachable=True)
            return
        ban = self._bans.get(peer_id)
        if ban is not None and ban.unreachable and ban.until > time.monotonic():
            # it answers again (e.g. back from a network outage): routes may use it at once
            logger.info("peer %s is reachable again; lifting its ban", peer_id)
            del self._bans[peer_id]
        self.rtts[peer_id] = smooth(self.rtts.get(peer_id), sample)
        self._measured_at[peer_id] = time.monotonic()

    def observe(self, peer_id: str, seconds: float, blocks: int, tokens: int) -> None:
        """Record that a step of `tokens` tokens (batch x positions) through `blocks` blocks of `peer_id` took
        `seconds` as the client saw it (network included): routes then price the peer at no more than a small factor
        of the throughput this shows (client.swarm.routing.believed_throughput). Steps no longer than the round trip to the
        peer tell nothing and are ignored. Pure bookkeeping: never raises, never blocks."""
        sample = measured_speed(seconds, self.rtts.get(peer_id), blocks, tokens)
        if sample is not None:
            self.speeds[peer_id] = smooth(self.speeds.get(peer_id), sample)

    def open_timeout(self, peer_id: str) -> float:
        """Seconds a new stream to `peer_id` may take to open: OPEN_TIMEOUT_RTTS of its round trip (the others' median
        if not measured yet), at least OPEN_TIMEOUT_FLOOR, at most `connect_timeout` (also before any is measured). A
        host cut off the network never refuses: every stream to it would wait `connect_timeout` in a failover."""
        rtt = self.rtts.get(peer_id)
        if rtt is None:  # (the others' median only then: this runs at every stream opened and every stall check)
            if not self.rtts:
                return self.config.connect_timeout
            rtt = statistics.median(self.rtts.values())
        return min(self.config.connect_timeout, max(OPEN_TIMEOUT_FLOOR, OPEN_TIMEOUT_RTTS * rtt))

    def info(self, peer_id: str) -> ServerInfo | None:
        """What `peer_id` announces in the swarm view at hand (None: not in it)."""
        return next((servers[peer_id] for servers in self.block_servers if peer_id in servers), None)

    # ------------------------------------------------------------------ bans
    def banned(self, unreachable_only: bool = False) -> set[str]:
        banned = banned_peers(self._bans, time.monotonic(), unreachable_only)
        if not unreachable_only:  # the common factors of failed push links, while other servers hold their blocks
            banned |= self.links.suspects()
        return banned | self.distrusted  # spot checks: a liar is skipped even as a block's only server

    def link_failed(self, pusher: str, receiver: str) -> set[str]:
        """A push from `pusher` to `receiver` failed with neither side provably at fault: count it. Peers that are
        now the common factor of failed links (client.swarm.links) are routed around like banned ones (`banned`)
        for as long as the record holds those failures, answering honestly meanwhile or not; returns them."""
        suspects = self.links.record(pusher, receiver)
        for peer in sorted(suspects & {pusher, receiver}):
            logger.warning("peer %s is the common factor of push links that failed (with %s): routing around it",
                           peer, ", ".join(sorted(self.links.partners()[peer])))
        return suspects

    def ban(self, peer_id: str, unreachable: bool = False, at_least: float = 0.0) -> None:
        """Avoid `peer_id` for a while: min_backoff after its first failure, doubling with each further one, and at
        least `at_least` seconds.

        `unreachable=True` (the peer could not be dialed) makes routes skip it even when it is a block's only server.
        """
        now, config = time.monotonic(), self.config
        ban = next_ban(self._bans.get(peer_id), now, config.min_backoff, config.max_backoff, unreachable,
                       config.unreachable_ban, at_least)
        self._bans[peer_id] = ban
        logger.info(
            "banned peer=%s for %.1fs after %d failure(s)%s",
            peer_id,
            ban.until - now,
            ban.failures,
            " (unreachable)" if unreachable else "",
        )
        if not unreachable:
            self._probe(peer_id)

    def _probe(self, peer_id: str) -> None:
        """Ping a peer that just failed, in the background: if it is gone, it is marked unreachable before some
        later route tries to dial it (its DHT record outlives it by up to the record's expiration)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on the client's loop (unit tests): nothing to probe with
            return
        task = loop.create_task(self._ping(peer_id))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    def after_failure(self, error: Exception, failures: int, span: Span) -> int:
        """The retry policy of sessions and forward passes: ban the span's server for a retryable error and return
        the new failure count; re-raise anything else, or a clear error once max_retries is spent.

        A server that cannot be dialed at all costs one fast failed dial and is skipped from then on, so it does not
        count against max_retries (their number is bounded by the servers in the swarm).
        """
        if not is_retryable(error):
            raise error
        unreachable = isinstance(error, PeerUnreachable)
        failures += 0 if unreachable else 1
        if failures > self.config.max_retries:
            if isinstance(error, RemoteError) and error.code == ErrorCode.SERVER_FULL.value:
                raise AllocationFailed(
                    f"no server of blocks {span.start}:{span.end} could hold the session "
                    f"after {failures} attempts; last answer: {error}"
                ) from error
            raise PeerUnavailable(
                f"blocks {span.start}:{span.end} failed {failures} times; last error: {error}"
            ) from error
        logger.warning(
            "server %s failed on blocks %d:%d (%s); routing around it", span.peer_id, span.start, span.end, error
        )
        # a malformed answer (NaN, wrong shape, absurd values) is the server's own doing, not a passing fault
        self.ban(span.peer_id, unreachable=unreachable,
                 at_least=self.config.max_backoff if isinstance(error, PeerUnavailable) and error.own_doing else 0.0)
        if isinstance(error, RemoteError) and error.code == ErrorCode.NOT_SERVED.value:
            self.invalidate()  # that server moved: our view of the swarm is stale
        return failures

    async def backoff(self, failures: int) -> None:
        """Retries after the first failure go at once (to a replica), on the view at hand; later ones wait longer
        (bans.retry_delay) and re-read the swarm first."""
        if failures <= 1:  # the first retry goes at once, on the view at hand (re-read in the background if due)
            self.refresh_soon()
            return
        delay = retry_delay(failures, self.config.min_backoff)
        if delay > 0:
            await asyncio.sleep(delay)
        await self.update(force=failures > 1)

    def forgive(self, peer_id: str) -> None:
        """A successful request resets the peer's backoff."""
        self._bans.pop(peer_id, None)

    # ------------------------------------------------------------------ routes
    async def make_route(
        self, start: int, end: int, cache_tokens_needed: int = 0, adapter: str | None = None, push: bool | None = None,
        fresh: bool = True,
    ) -> list[Span]:
        """The fastest chain of spans covering [start, end) for an inference session (see routing.find_route),
        through servers holding LoRA `adapter` (default: the client's `active_adapter`).

        `push` (default: ClientConfig.push) prices the route as a push route (client -> A -> B -> client, with the
        server-to-server round trips servers announce) rather than a relayed one. A push session prices its routes
        so even where some of its steps go relayed (client.chain.push_route.can_push: a single span, deep prompts), and
        when it re-routes one part of its route after a failure (the part's ends are then priced as legs to and
        from the client, though its neighbours on the route send and receive them): pushing is what most of its
        steps do, and a route is chosen once for all of them.

        `fresh` False (a failover) routes on the view at hand when it has a route, re-reading the swarm in the
        background if due (`refresh_soon`); a route that fails is retried after a re-read (`backoff`).
        """
        adapter = adapter if adapter is not None else self.config.active_adapter
        push = self.config.push if push is None else push
        return await self._route(start, end, self._planner(None, start, end, cache_tokens_needed, adapter, push),
                                 adapter, fresh)

    async def make_standby(self, span: Span, exclude: Collection[str], cache_tokens_needed: int = 0) -> Span | None:
        """Another server for all of span's blocks (a standby replica, client.chain.standby), chosen as `make_route`
        chooses among the servers that hold them whole, none of `exclude` nor banned; None when there is none."""
        await self.update()
        adapter = self.config.active_adapter
        view = whole_span_view(self.block_servers, span.start, span.end)
        plan = self._planner(view, span.start, span.end, cache_tokens_needed, adapter, self.config.push)
        route = plan(self.banned() | set(exclude))
        return route[0] if route is not None and len(route) == 1 else None

    def _planner(self, view: list[dict[str, ServerInfo]] | None, start: int, end: int, cache_tokens_needed: int,
                 adapter: str | None, push: bool):
        """plan(banned) -> the fastest route over [start, end) in `view` (None: the swarm as read when planning;
        routing.find_route), or None."""

        def plan(banned: set[str]) -> list[Span] | None:
            return find_route(
                self.block_servers if view is None else view,
                start,
                end,
                banned=banned,
                cache_tokens_needed=cache_tokens_needed,
                hop_cost=self.config.hop_cost,
                rtts=self.rtts,
                default_rtt=self.config.default_rtt,
                adapter=adapter,
                allowed_quant=self.config.allowed_quant,
                relay_cost=self.config.relay_cost,
                push=push,
                measured=self.speeds,
                rng=self._rng,  # a sample of the swarm, drawn by this client: clients spread (routing docstring)
            )

        return plan

    async def make_forward_route(self, start: int, end: int) -> list[Span]:
        """A chain for a stateless forward/backward pass, drawn in proportion to server throughput."""
        return await self._route(
            start,
            end,
            lambda banned: sample_route(
                self.block_servers,
                start,
                end,
                self._rng,
                banned=banned,
                adapter=self.config.active_adapter,
                allowed_quant=self.config.allowed_quant,
                measured=self.speeds,
            ),
            self.config.active_adapter,
        )

    async def _route(self, start: int, end: int, plan, adapter: str | None, fresh: bool = True) -> list[Span]:
        """plan(banned) with every ban, else with only unreachable peers excluded; waits up to missing_blocks_wait
        for servers (re-reading the DHT), then raises MissingBlocks naming the blocks nobody reachable holds.
        `fresh`: re-read the swarm first if due (else in the background, unless the view was never read or is
        invalidated)."""
        if fresh or self._stale or self.last_update == -float("inf"):
            await self.update()
        else:
            self.refresh_soon()
        deadline = time.monotonic() + self.config.missing_blocks_wait
        while True:
            route = plan(self.banned())
            if route is None:
                route = plan(self.banned(unreachable_only=True))
            if route is not None:
                return route
            if time.monotonic() >= deadline:
                raise self._missing(start, end, adapter)
            await asyncio.sleep(0.25)
            await self.update(force=True)

    def _missing(self, start: int, end: int, adapter: str | None) -> MissingBlocks:
        """MissingBlocks for [start, end), naming the requested LoRA adapter or the allowed quantizations when
        that is what excludes the servers holding them."""
        banned, allowed = self.banned(unreachable_only=True), self.config.allowed_quant
        blocks = uncovered_blocks(self.block_servers, start, end, banned, adapter, allowed)
        error = MissingBlocks(blocks)
        if adapter is not None:
            error = MissingBlocks(
                blocks,
                f"{error} with the LoRA adapter {adapter!r} (servers load adapters with "
                f"`corolla serve ... --adapters`)",
            )
        if allowed is None:
            return error
        excluded = sorted(
            {info.quant for b in blocks for _, info in usable_servers(self.block_servers, b, banned, adapter)}
        )
        if not excluded:
            return error
        return MissingBlocks(
            blocks,
            f"{error} with quantization in {tuple(map(str, allowed))}: the servers holding "
            f"them announce quantization {list(map(str, excluded))}, which "
            "ClientConfig.allowed_quant excludes",
        )

    async def close(self) -> None:
        for task in [self._pings, self._refresh, *self._probes]:
            if task is not None:
                task.cancel()
