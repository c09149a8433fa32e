"""Simulated inference sessions, from arrival to their last token, with the client's failover.

    arrive -> route (the policy's, through the view its region's clients last read) -> open every span
    (reserve cache: server.cache.queue decides; a full server keeps the request up to alloc_timeout) -> prefill
    -> decode (corolla.sim.fluid) -> finish (release every reservation)

A corolla route's spans are opened at once, as client.chain.route_opening.open_route opens them (an `Opening`): the
client waits until every one has opened or failed, and if any failed it closes them all (their servers free what
they reserved), bans the server of the first failed one in route order, waits the policy's delay and routes the
same blocks again. So a session that cannot get room on every span of its route holds none of it for longer than
one allocation wait. (A policy without `opens_at_once`, Petals', routes a failed span's blocks again alone and
keeps the others.)

A span whose server fails once the route is open is replaced as the real client does: who is at fault and what is
redone come from client.chain.failover_plan (a silent server after the first span costs one relayed attempt before
it is replaced), the server is banned (client.swarm.bans with the policy's figures), the retry waits the policy's
delay, the span's blocks get a new route (banned servers excluded; if that finds none, only unreachable ones), the
new spans are opened (an opening of their own), and the tokens so far are replayed into them (a prefill of prompt +
generated tokens). Errors count as the client's `after_failure` counts them: a server that cannot be dialed does not
use up a retry.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from corolla.client.chain.failover_plan import repair_plan
from corolla.client.swarm.bans import Ban, banned_peers
from corolla.client.swarm.routing import Span
from corolla.protocol.errors import PeerUnavailable, PeerUnreachable, RemoteError
from corolla.protocol.messages import ErrorCode
from corolla.sim import servers as srv

if TYPE_CHECKING:
    from corolla.sim.simulator import World

DIAL_FAILURE_SECONDS = 1.0  # a client learns that a listed server is gone when dialing it fails
MISSING_POLL = 0.25  # seconds between re-reads while some block has no server (SequenceManager._route)
ERRORS = {
    "unreachable": lambda: PeerUnreachable("could not dial"),
    "crash": lambda: PeerUnavailable("stream broke"),
    "shutting_down": lambda: RemoteError(ErrorCode.SHUTTING_DOWN.value, "server leaving"),
    "not_served": lambda: RemoteError(ErrorCode.NOT_SERVED.value, "blocks not served"),
    "server_full": lambda: RemoteError(ErrorCode.SERVER_FULL.value, "no cache room"),
}
_leg_ids = itertools.count()


@dataclass(eq=False)
class Leg:
    """One span of a session's route and its state at its server."""

    span: Span
    server: int
    id: int = field(default_factory=lambda: next(_leg_ids))
    granted: bool = False
    failed: bool = False
    filled: bool = False  # its server's cache holds the session's tokens so far
    opening: Opening | None = None  # the opening it is part of, until that has settled
    origin: Opening | None = None  # the opening it came from (kept: a failover's replay is part of it)
    error: str | None = None  # why it failed (ERRORS), while its opening has not settled


@dataclass(eq=False)
class Opening:
    """The spans one route opens at once (client.chain.route_opening.open_route gathers their opens): `waiting`
    of them have neither opened nor failed yet."""

    legs: list[Leg]
    waiting: int
    failures: int = 0  # open_route's own count of failed attempts, this one's predecessors'


@dataclass(eq=False)
class SimSession:
    id: int
    region: int
    access: float
    prompt: int
    new_tokens: int
    arrived: float
    client: int | None = None  # closed-loop client running it
    legs: list[Leg] = field(default_factory=list)
    bans: dict[str, Ban] = field(default_factory=dict)
    failures: int = 0
    generation: int = 0  # bumped when a failure cancels the prefill in flight
    slot: int | None = None  # fluid row while decoding
    decoded: float = 0.0
    first_token: float | None = None
    admitted: float | None = None
    stalled_since: float | None = None
    missing_since: float | None = None
    done: bool = False

    @property
    def need(self) -> int:
        return self.prompt + self.new_tokens

    def leg(self, leg_id: int) -> Leg | None:
        return next((leg for leg in self.legs if leg.id == leg_id), None)


def start(w: World, s: SimSession) -> None:
    _route(w, s, None)


def _route(w: World, s: SimSession, failed: list[Leg] | None, failures: int = 0) -> None:
    """Route the whole model (failed None) or the blocks of failed legs (consecutive ones of the route), then open
    the new legs, all at once; `failures`: the opening's failed attempts so far (open_route's count)."""
    if s.done or (failed is not None and any(leg not in s.legs for leg in failed)):
        return
    start, end = (0, w.scenario.blocks) if failed is None else (failed[0].span.start, failed[-1].span.end)
    now = w.q.now
    index = w.index_for(s.region, force=s.missing_since is not None)
    spans = w.policy.route(index, start, end, w.rng, banned_peers(s.bans, now))
    if spans is None:
        spans = w.policy.route(index, start, end, w.rng, banned_peers(s.bans, now, unreachable_only=True))
    if spans is None:
        s.missing_since = s.missing_since if s.missing_since is not None else now
        if now - s.missing_since >= w.missing_wait and (w.policy.max_stall == float("inf")
                                                          or _stalled_too_long(w, s, now - s.missing_since)):
            _fail(w, s, "missing blocks")
        else:
            w.q.after(MISSING_POLL, _route, w, s, failed, failures)
        return
    s.missing_since = None
    new = [Leg(span, w.peer_ids[span.peer_id]) for span in spans]
    if w.policy.opens_at_once:
        opening = Opening(new, len(new), failures)
        for leg in new:
            leg.opening = leg.origin = opening
    if failed is None:
        s.legs = new
    else:
        at = s.legs.index(failed[0])
        s.legs[at : at + len(failed)] = new
    for leg in new:
        _open(w, s, leg)


def _stalled_too_long(w: World, s: SimSession, waited: float = 0.0) -> bool:
    since = s.stalled_since if s.stalled_since is not None else w.q.now - waited
    return w.q.now - since > w.policy.max_stall


def _open(w: World, s: SimSession, leg: Leg) -> None:
    server = w.servers[leg.server]
    if not server.alive:
        w.q.after(DIAL_FAILURE_SECONDS, _leg_failed, w, s, leg, "unreachable")
        return
    if not server.serves(leg.span.start, leg.span.end):
        error = "shutting_down" if server.state == "draining" else "not_served"
        w.q.after(w.rtt(s, server), _leg_failed, w, s, leg, error)
        return
    tokens = srv.cache_tokens(s.need, leg.span.length, server.end - server.start)
    if srv.request_cache(w, server, s.id, leg.id, tokens):
        granted(w, s, leg)
    else:
        w.q.after(w.alloc_timeout, _alloc_timeout, w, s, leg)


def _alloc_timeout(w: World, s: SimSession, leg: Leg) -> None:
    if s.done or leg.granted or leg.failed or leg not in s.legs:
        return
    srv.withdraw(w, w.servers[leg.server], s.id, leg.id)
    _leg_failed(w, s, leg, "server_full")


def granted(w: World, s: SimSession, leg: Leg) -> None:
    if s.done or leg not in s.legs or leg.failed:
        return
    leg.granted = True
    if leg.opening is not None:
        _settle(w, s, leg)
    elif all(g.granted for g in s.legs):
        _prefill(w, s)


def _settle(w: World, s: SimSession, leg: Leg) -> None:
    """`leg` of an opening has opened or failed; once all of them have, the route goes on (all opened) or is
    closed and routed again (open_route's `except`: the first failed span in route order is blamed)."""
    opening = leg.opening
    assert opening is not None
    opening.waiting -= 1
    if opening.waiting > 0:
        return
    for each in opening.legs:
        each.opening = None
    failed = [each for each in opening.legs if each.failed]
    if not failed:
        if all(g.granted for g in s.legs):
            _prefill(w, s)
        return
    _close(w, s, opening.legs)
    first = failed[0]
    _after_failure(w, s, first, first.error or "crash", opening.legs, 0.0, opening, failed)


def _close(w: World, s: SimSession, legs: list[Leg]) -> None:
    """The client closes these spans (open_route's `except`): the servers of those still open free what they
    granted or still queue."""
    for each in legs:
        if not each.failed:
            each.failed = True
            server = w.servers[each.server]
            if server.alive:
                srv.withdraw(w, server, s.id, each.id if not each.granted else None)
            each.granted = False


def _prefill(w: World, s: SimSession) -> None:
    """Every span is open: fill the caches that need it (the prompt on a new route; after a failover, the prompt
    and the tokens so far, replayed into the new spans only), then decode."""
    now = w.q.now
    if s.admitted is None:
        s.admitted = now
        w.metrics.admitted(s, now)
    tokens = s.prompt + int(s.decoded)
    empty = [leg for leg in s.legs if not leg.filled]
    if len(empty) == len(s.legs):  # the whole route: one pass through it
        seconds = w.legs_seconds(s) + w.scenario.client_overhead
    else:  # the new spans, each replayed by the client
        seconds = sum(w.rtt(s, w.servers[leg.server]) for leg in empty)
    replay = len(empty) < len(s.legs) and w.policy.replays_in_short_chunks
    for leg in empty:
        seconds += w.prefill_visit(leg.server, leg.span.length, tokens, chunked=replay)
    s.generation += 1
    w.q.after(seconds, _decode, w, s, s.generation)


def _decode(w: World, s: SimSession, generation: int) -> None:
    if s.done or s.generation != generation:
        return
    if s.first_token is None:
        s.first_token = w.q.now
        s.decoded = 1.0
        w.metrics.first_token(s, w.q.now)
    s.stalled_since = None
    s.failures = 0  # the client counts failures per step: this one went through
    for leg in s.legs:
        leg.filled = True
    hops = [(leg.server, leg.span.length) for leg in s.legs]
    s.slot = w.fluid.add(hops, w.legs_seconds(s) + w.scenario.client_overhead, s.decoded, float(s.new_tokens),
                         w.q.now)
    w.slot_sessions[s.slot] = s


def _stop_decoding(w: World, s: SimSession) -> None:
    if s.slot is not None:
        s.decoded = w.fluid.remove(s.slot)
        w.slot_sessions.pop(s.slot, None)
        s.slot = None


def finish(w: World, s: SimSession, at: float) -> None:
    """The session's last token came at `at`."""
    _release(w, s)
    s.done = True
    w.metrics.finished(s, at)
    w.session_over(s, at)


def _release(w: World, s: SimSession) -> None:
    _stop_decoding(w, s)
    for leg in s.legs:
        server = w.servers[leg.server]
        if server.alive:
            srv.withdraw(w, server, s.id, leg.id if not leg.granted else None)


def _fail(w: World, s: SimSession, why: str) -> None:
    _release(w, s)
    s.done = True
    w.metrics.failed(s, w.q.now, why)
    w.session_over(s, w.q.now)


def server_failed(w: World, s: SimSession, server_id: int, kind: str) -> None:
    """Every leg of `s` on `server_id` failed with `kind` (ERRORS)."""
    for leg in [leg for leg in s.legs if leg.server == server_id and not leg.failed]:
        _leg_failed(w, s, leg, kind)


def _leg_failed(w: World, s: SimSession, leg: Leg, kind: str) -> None:
    """`leg` failed with `kind`: ban its server, back off, re-route its blocks."""
    if s.done or leg.failed or leg not in s.legs:
        return
    leg.failed = True
    _stop_decoding(w, s)  # decoding stops until the route is whole again
    if s.stalled_since is None:
        s.stalled_since = w.q.now
    s.generation += 1  # a prefill in flight is lost
    server = w.servers[leg.server]
    w.metrics.leg_failure()
    if server.alive:
        srv.withdraw(w, server, s.id, leg.id if not leg.granted else None)
    was_granted, leg.granted = leg.granted, False
    if leg.opening is not None:  # the client learns it when the route's other spans have answered too
        leg.error = kind
        if not was_granted:  # an opened span that breaks before the others answer was settled already
            _settle(w, s, leg)
        return
    origin = leg.origin
    if origin is not None and not leg.filled and s.first_token is not None:
        # a failover's new span failed while the tokens so far were replayed into it: that is still open_route
        # (it replays before it returns), which closes its spans, counts the failure as its own and routes again
        opened = [each for each in origin.legs if each in s.legs]
        _close(w, s, opened)
        _after_failure(w, s, leg, kind, opened, 0.0, origin)
        return
    extra = 0.0
    error = ERRORS[kind]()
    if s.first_token is not None and repair_plan(s.legs.index(leg), error).action == "relay_unpushed":
        extra = w.rtt(s, server)  # the step relayed to it fails too before it is replaced
    _after_failure(w, s, leg, kind, [leg], extra)


def _after_failure(w: World, s: SimSession, leg: Leg, kind: str, failed: list[Leg], extra: float,
                   opening: Opening | None = None, refused: list[Leg] | None = None) -> None:
    """The client's `after_failure` and backoff for a failure of `leg` with `kind`: count it, give up or ban its
    server, and route the blocks of `failed` again after the retry delay (+ `extra` seconds). A failure of an
    `opening` counts as open_route counts it (its own attempts, from 0 for each span it replaces): every span of it
    that `refused` to open (in route order, `leg` first; their `error`s) is one failure and its server banned,
    as client.chain.route_opening.count_refusals does; one of the route that is open, as the step that found it
    does (`s.failures`, until a step goes through); either way, over the client's max_retries the session fails."""
    if opening is None:
        error = ERRORS[kind]()
        unreachable = isinstance(error, PeerUnreachable)
        s.failures += 0 if unreachable else 1
        count = s.failures
        faults = [(leg, kind, unreachable)]
    else:
        count = opening.failures
        faults = [(each, each.error or kind, isinstance(ERRORS[each.error or kind](), PeerUnreachable))
                  for each in (refused or [leg])]
    if _stalled_too_long(w, s):
        _fail(w, s, kind)
        return
    for each, why, unreachable in faults:  # after_failure, once per refusal: count, give up, or ban
        if opening is not None:
            count += 0 if unreachable else 1
        if w.policy.gives_up(count):
            _fail(w, s, why)
            return
        peer = w.servers[each.server].peer
        s.bans[peer] = w.policy.ban(s.bans.get(peer), w.q.now, unreachable)
    carried = 0 if opening is None else count  # a fresh open_route replaces an open route's span
    w.q.after(w.policy.retry_delay(count) + extra, _route, w, s, failed, carried)


def leg_failed(w: World, s: SimSession, leg_id: int, kind: str) -> None:
    leg = s.leg(leg_id)
    if leg is not None:
        _leg_failed(w, s, leg, kind)


def leg_granted(w: World, s: SimSession, leg_id: int) -> None:
    leg = s.leg(leg_id)
    if leg is not None:
        granted(w, s, leg)
