"""Simulated servers: their life from joining to leaving, every decision taken by the policy (corolla.sim.policy).

    starting --join delay--> choose blocks, announce JOINING --settle (corolla)--> loading --k x load time-->
    online --(check: a move)--> draining (serving open sessions, JOINING on the target) --> loading --> online
    any state --churn--> gone (a crash leaves its record until it expires; a graceful leave announces OFFLINE)

Every scheduled event carries the server's `epoch`, bumped at each change of state, so that an event planned for
a state the server has left does nothing. Records are re-announced every `announce_period` with the server's load
(sessions holding cache, sessions queued for it, step_seconds from the fluid model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from corolla.protocol.messages import ServerState
from corolla.server.cache.queue import CacheRequest, grants, peer_limit
from corolla.server.presence.rebalancing import WATCH_HOLDERS, WATCH_READS, Move, uncovered, watch_order, with_own
from corolla.server.presence.silence import Silence
from corolla.sim.dht import Record
from corolla.sim.scenario import SpeedClass

if TYPE_CHECKING:
    from corolla.sim.simulator import World

MAX_SETTLES = 3  # re-choices before loading, at most
PAST_PEAK = 1.0  # the fluid model's overload (demand over the peak rate) past which a server's compute is saturated


@dataclass(eq=False)
class SimServer:
    id: int
    peer: str
    region: int
    access: float  # seconds, added to its round trips
    kind: SpeedClass
    throughput: float  # announced, tokens/s per block (the policy's definition)
    inference_rate: float  # single-token steps/s per block
    fixed: tuple[int, int] | None = None  # --blocks A:B: never moves
    state: str = "starting"  # starting | joining | loading | online | draining | gone
    start: int = 0
    end: int = 0
    target: tuple[int, int] | None = None  # blocks it is moving to (while draining)
    epoch: int = 0
    alive: bool = True
    last_move: float = 0.0
    moves: int = 0
    settles: int = 0
    watching: bool = False  # its coverage watch is running
    watch_ticks: int = 0
    silence: Silence = field(default_factory=Silence)  # its watch's judgement of the servers it pings
    counted: set[int] = field(default_factory=set)  # the servers found gone that its last read came after
    cache_free: int = 0
    sessions: dict[int, int] = field(default_factory=dict)  # session id -> cache tokens it holds here
    queue: dict[str, CacheRequest] = field(default_factory=dict)  # request owner -> request, oldest first
    queue_min: float = math.inf  # at most the fewest tokens a queued request asks for (a lower bound)
    waiting: dict[str, tuple[int, int]] = field(default_factory=dict)  # request owner -> (session id, leg id)

    @property
    def blocks(self) -> int:
        return self.kind.blocks

    def serves(self, start: int, end: int) -> bool:
        """Whether it takes new sessions on [start, end) now."""
        return self.alive and self.state == "online" and self.start <= start and end <= self.end


def share(w: World, server: SimServer, start: int, end: int) -> float:
    return w.policy.placement_share(server.throughput, start, end)


def announce(w: World, server: SimServer, state: ServerState | None = None) -> None:
    """Store the server's record now (its current blocks, or its target while it drains) and plan its expiry."""
    if state is None:
        state = ServerState.ONLINE if server.state == "online" else ServerState.JOINING
    start, end = server.target if server.state == "draining" and server.target else (server.start, server.end)
    expires = w.q.now + w.policy.expiration
    load = w.policy.load_aware and server.state in ("online", "draining")
    w.dht.store(server.id, Record(
        server.peer, state, start, end, server.throughput, share(w, server, start, end),
        len(server.sessions) if load else 0, len(server.queue) if load else 0,
        min(w.fluid.announced_step_seconds(server.id), 600.0) if load else 0.0,
        server.cache_free, server.kind.cache_tokens, expires, server.inference_rate))
    w.q.at(expires, _expire, w, server.id)


def _expire(w: World, server_id: int) -> None:
    w.dht.expire(server_id, w.q.now)


def _periodic_announce(w: World, server: SimServer, epoch: int) -> None:
    if server.epoch != epoch or not server.alive:
        return
    announce(w, server)
    w.q.after(w.policy.announce_period, _periodic_announce, w, server, epoch)


def _enter(w: World, server: SimServer, state: str) -> int:
    """Switch state (invalidating events planned for the old one), announce, and keep announcing."""
    server.state = state
    server.epoch += 1
    if state in ("joining", "loading", "online", "draining"):
        announce(w, server)
        w.q.after(w.policy.announce_period, _periodic_announce, w, server, server.epoch)
    return server.epoch


# ---------------------------------------------------------------- joining
def appear(w: World, server: SimServer) -> None:
    """The server process starts: it waits its join delay, then chooses."""
    w.fluid.set_server(server.id, server.kind.speed, server.blocks)
    server.cache_free = server.kind.cache_tokens
    w.q.after(w.policy.join_delay(w.rng), _choose, w, server, server.epoch)


def _choose(w: World, server: SimServer, epoch: int) -> None:
    if server.epoch != epoch or not server.alive:
        return
    if server.fixed is not None:
        server.start, server.end = server.fixed
    else:
        w.dht.read_all(by_server=True)
        server.start, server.end = w.policy.choose(w.dht.capacity_without(server.id), server.blocks, w.rng)
    w.fluid.set_server(server.id, server.kind.speed, server.end - server.start)
    epoch = _enter(w, server, "joining")
    delay = None if server.fixed else w.policy.settle_delay(w.rng)
    if delay is None:
        _load(w, server)
    else:
        w.q.after(delay, _settle, w, server, epoch)


def _settle(w: World, server: SimServer, epoch: int) -> None:
    if server.epoch != epoch or not server.alive:
        return
    w.dht.read_all(by_server=True)
    current = (server.start, server.end)
    others = w.dht.joining_overlapping(server.id, *current)
    target = w.policy.settle(server.peer, current, share(w, server, *current), w.dht.capacity_without(server.id),
                             others)
    if target is not None and server.settles < MAX_SETTLES:
        server.settles += 1
        server.start, server.end = target
        epoch = _enter(w, server, "joining")
        w.q.after(w.policy.settle_delay(w.rng) or 0.0, _settle, w, server, epoch)
        return
    _load(w, server)


def _load(w: World, server: SimServer) -> None:
    epoch = _enter(w, server, "loading")
    w.q.after(w.scenario.load_seconds_per_block * (server.end - server.start), _online, w, server, epoch)


def _online(w: World, server: SimServer, epoch: int) -> None:
    if server.epoch != epoch or not server.alive:
        return
    epoch = _enter(w, server, "online")
    w.coverage_changed(server, +1)
    if server.fixed is None:
        w.q.after(w.policy.check_delay(w.rng), _check, w, server, epoch)
        _schedule_watch(w, server, epoch)


# ---------------------------------------------------------------- moving
def _schedule_watch(w: World, server: SimServer, epoch: int) -> None:
    """Keep watching while the policy wants it (the balance check looks again: `_check`)."""
    period = w.policy.watch_period(w.dht.holders.tolist())
    server.watching = period is not None
    if period is not None:
        w.q.after(period, _watch, w, server, epoch)


def _gone(w: World, server: SimServer) -> set[int]:
    """What the watch's pings find: the servers of thinly served blocks that are no longer there, counted as
    server.presence.silence counts them (silent over two rounds `confirm` seconds apart; the simulated pings of a
    live server never miss)."""
    thin = w.dht.thin_holders(server.id, WATCH_HOLDERS)
    pinged = [w.peer_ids[peer] for peer in watch_order(server.peer, {w.servers[s].peer: n for s, n in thin.items()})]
    silent = {s for s in pinged if not w.servers[s].alive}
    return server.silence.round(set(pinged) - silent, silent, w.q.now)


def _watch(w: World, server: SimServer, epoch: int) -> None:
    """server.rebalancer's watch: pings the servers of thinly served blocks, re-reads the swarm every WATCH_READS
    times or when one was newly found gone."""
    if server.epoch != epoch or not server.alive:
        return
    server.watch_ticks += 1
    gone = _gone(w, server)
    if gone - server.counted or server.watch_ticks % WATCH_READS == 0:  # re-read once per server found gone
        w.dht.read_all(by_server=True)
    server.counted = gone
    own = share(w, server, server.start, server.end)
    capacity = with_own(w.dht.capacity_without(server.id, gone), (server.start, server.end), own)
    if uncovered(capacity):
        _decide(w, server, epoch, staggered=False)
    if server.epoch == epoch:
        _schedule_watch(w, server, epoch)


def _check(w: World, server: SimServer, epoch: int) -> None:
    if server.epoch != epoch or not server.alive:
        return
    w.dht.read_all(by_server=True)
    _decide(w, server, epoch, staggered=False)
    if server.epoch == epoch:
        w.q.after(w.policy.check_delay(w.rng), _check, w, server, epoch)
        if not server.watching:
            _schedule_watch(w, server, epoch)


def _plan(w: World, server: SimServer) -> Move | None:
    current = (server.start, server.end)
    watching = w.policy.watch_period(w.dht.holders.tolist()) is not None
    capacity = w.dht.capacity_without(server.id, _gone(w, server) if watching else ())
    return w.policy.plan(current, share(w, server, *current), capacity, w.q.now - server.last_move, w.rng,
                         w.swarm_spans())


def _decide(w: World, server: SimServer, epoch: int, staggered: bool) -> None:
    """Plan a move; a first positive plan waits the policy's stagger, re-reads and plans again."""
    if server.epoch != epoch or not server.alive or server.state != "online":
        return
    if staggered:
        w.dht.read_all(by_server=True)
    move = _plan(w, server)
    if move is None:
        return
    delay = 0.0 if staggered else w.policy.stagger(w.rng, move)
    if delay > 0:
        w.q.after(delay, _decide, w, server, epoch, True)
    else:
        _begin_move(w, server, move)


def _begin_move(w: World, server: SimServer, move: Move) -> None:
    w.coverage_changed(server, -1)
    server.moves += 1
    server.last_move = w.q.now
    server.target = move.target
    w.metrics.moved(w.q.now)
    epoch = _enter(w, server, "draining")
    drain = w.policy.drain(move)
    if drain <= 0 or not server.sessions:
        _end_drain(w, server, epoch)
    else:
        w.q.after(drain, _end_drain, w, server, epoch)


def _end_drain(w: World, server: SimServer, epoch: int) -> None:
    if server.epoch != epoch or not server.alive:
        return
    assert server.target is not None
    server.state = "leaving"  # not draining any more: releases below must not end the drain again
    _drop_sessions(w, server, "shutting_down")
    server.start, server.end = server.target
    server.target = None
    w.fluid.set_server(server.id, server.kind.speed, server.end - server.start)
    _load(w, server)


def session_left(w: World, server: SimServer) -> None:
    """A session released its cache here: a draining server with none left moves on at once."""
    if server.state == "draining" and not server.sessions:
        _end_drain(w, server, server.epoch)


# ---------------------------------------------------------------- leaving
def leave(w: World, server: SimServer, crash: bool) -> None:
    """The server goes away; a graceful one announces OFFLINE, a crashed one's record stays until it expires."""
    if not server.alive:
        return
    if server.state == "online":
        w.coverage_changed(server, -1)
    if not crash and server.state != "starting":
        announce(w, server, ServerState.OFFLINE)
    server.alive = False
    server.state = "gone"
    server.epoch += 1
    _drop_sessions(w, server, "crash" if crash else "shutting_down")


def _drop_sessions(w: World, server: SimServer, kind: str) -> None:
    """Every session holding or waiting for cache here loses this span."""
    waiting = list(server.waiting.values())
    server.waiting.clear()
    server.queue.clear()
    server.queue_min = math.inf
    for session_id, leg in waiting:
        w.leg_failed(session_id, leg, kind)
    for session_id in list(server.sessions):
        w.server_failed(session_id, server.id, kind)
    server.sessions.clear()
    server.cache_free = server.kind.cache_tokens


# ---------------------------------------------------------------- cache
def cache_tokens(need: int, used: int, blocks: int) -> int:
    """Tokens a session of `need` tokens over `used` of a server's `blocks` blocks takes from its budget (as
    server.compute.block_stack.BlockStack.cache_tokens counts them, without sliding-window rings)."""
    return math.ceil(need * used / blocks)


def saturated(w: World, server: SimServer) -> bool:
    """The server's compute is past its peak (server.compute.saturation), under a policy that admits by compute: in
    the fluid model, a queue in front of it (its steps wait behind full batches). Then server.cache.queue.grants
    (saturated=True) grants nothing, which `request_cache` and `grant` apply as a shortcut."""
    return w.policy.admits_by_compute and bool(w.fluid.overload[server.id] > PAST_PEAK)


def under_peak(w: World) -> list[int]:
    """The ids of the servers `saturated` says are not (by the same rule, over every server at once)."""
    if not w.policy.admits_by_compute:
        return list(range(len(w.servers)))
    return np.flatnonzero(w.fluid.overload[: len(w.servers)] <= PAST_PEAK).tolist()


def request_cache(w: World, server: SimServer, session_id: int, leg: int, tokens: int) -> bool:
    """Queue a reservation for leg `leg` of a session; True if it was granted at once (else it waits for
    `grant`)."""
    owner = str(leg)
    server.queue[owner] = CacheRequest(owner, str(session_id), tokens, w.q.now)
    server.queue_min = min(server.queue_min, tokens)
    server.waiting[owner] = (session_id, leg)
    if tokens > server.cache_free or saturated(w, server):
        # exact shortcut: it cannot be granted now, and a request at the end of the queue changes no grant of the
        # requests before it (server.cache.queue scans oldest first), so there is nothing to ask grants() yet
        return False
    return grant(w, server, answer_now=owner)


def grant(w: World, server: SimServer, answer_now: str | None = None) -> bool:
    """Grant what server.cache.queue.grants says fits; `answer_now`'s grant is returned instead of delivered."""
    if not server.queue or server.cache_free < server.queue_min or saturated(w, server):
        # exact shortcuts: grants() grants a request only if it fits in the free tokens, and none is that small;
        # and nothing while the server is past its peak
        return False
    queue = list(server.queue.values())
    # what the queued requests' peers (sessions) hold here, all grants() looks up: only those holding something
    # (grants() counts a peer it is not told of as holding nothing)
    sessions = server.sessions
    held = {str(sid): sessions[sid] for sid, _ in server.waiting.values() if sid in sessions}
    limit = peer_limit(server.kind.cache_tokens, w.policy_peer_share)
    owners = grants(server.cache_free, held, limit, queue, w.q.now, w.cache_patience)
    requests = [server.queue.pop(owner) for owner in owners]
    server.queue_min = min((r.tokens for r in server.queue.values()), default=math.inf)
    mine = False
    for request in requests:
        session_id, leg = server.waiting.pop(request.owner)
        server.cache_free -= request.tokens
        server.sessions[session_id] = server.sessions.get(session_id, 0) + request.tokens
        if request.owner == answer_now:
            mine = True
        else:
            w.leg_granted(session_id, leg)
    return mine


def withdraw(w: World, server: SimServer, session_id: int, leg: int | None) -> None:
    """A session gives up waiting here for leg `leg`, or releases everything it holds here (`leg` None)."""
    if leg is not None:
        owner = str(leg)
        if server.waiting.pop(owner, None) is not None:
            del server.queue[owner]
        return
    tokens = server.sessions.pop(session_id, 0)
    server.cache_free += tokens
    if tokens:
        grant(w, server)
        session_left(w, server)
