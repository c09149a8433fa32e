"""When a server picks its blocks and when it moves: pure decisions over a view of the swarm, so that the server
(server.rebalancer) and the swarm simulator (corolla.sim) run the same code.

The view is one number per block: the *capacity* servers give it (`swarm_capacity`), each JOINING or ONLINE server
adding its throughput divided by its number of blocks (`block_share`): a server computes one token through all of
its blocks at a time, so a server of 20 blocks gives each of them a twentieth of its speed, not all of it (summing
whole throughputs made a block of big servers look 20 times stronger than it can serve).

A server's life, as these functions decide it:

    join:      wait join_delay (random: servers started together read different views), choose the weakest
               window (block_selection.choose_best_blocks), announce it JOINING at once (others see it taken)
    settle:    before loading, wait a short random delay, re-read, and `settle_move`: move for free (nothing is
               loaded yet) when should_move says so; when other JOINING servers share our blocks, they and we
               place ourselves one after another in peer-id order (the smallest stays), so that a herd that took
               the same blocks on a lagging view spreads at once and two servers never both leave the same blocks
    watch:     while the last read showed a block with fewer than WATCH_HOLDERS servers (`needs_watch`), re-read
               every watch period and ping the servers of such blocks (`to_check`): a crashed one's record stays
               until it expires, and a block it alone held must not look covered meanwhile; a server silent over
               two rounds counts as gone (server.presence.silence: one missed ping is not a death); a block
               without any live server (`uncovered`) triggers a check at once
    check:     every `check_delay` (the balance period, jittered), and at once on an uncovered block: `plan_move`
    move:      stagger (random delay, re-read, decide again), then drain: OFFLINE for new sessions, open ones
               served until they end or `drain_seconds` pass; then load the new blocks

`plan_move` moves only for a real gain (block_selection.should_move: the swarm's weakest blocks become fewer or
stronger, by more than `quality`), never onto blocks already being loaded by the mover itself, never breaking
coverage (the minimum never falls), and not again within `cooldown` of the last move unless a block has no server.
A move onto a block without any server is urgent (the swarm needs those blocks now): no cooldown, and no drain
when every block it leaves keeps another server (its sessions fail over at once); a move that leaves a block with
no server (allowed only when that uncovers fewer blocks than it covers) drains first.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from corolla.protocol.messages import ServerInfo, ServerState
from corolla.server.presence.block_selection import choose_best_blocks, should_move, weaker, weakness

WATCH_HOLDERS = 5  # a read showing a block with fewer servers than this keeps the watch polling (and pinging them)
WATCH_PINGS = 8  # servers one watcher pings per round at most (`watch_order`)
WATCH_READS = 6  # the watch re-reads the swarm every this many watch periods (and whenever a ping fails)


def block_share(throughput: float, start: int, end: int) -> float:
    """Tokens/s a server of `throughput` (tokens/s per block) on blocks [start, end) gives each of its blocks."""
    return throughput / max(1, end - start)


def swarm_capacity(block_servers: Sequence[Mapping[str, ServerInfo]], me: str | None = None,
                   gone: Collection[str] = ()) -> list[float]:
    """Per block, the summed `block_share` of every JOINING or ONLINE server announcing it, except `me` and the
    servers known to be `gone` (their records outlive them until they expire)."""
    return [
        sum(block_share(info.throughput, info.start_block, info.end_block)
            for peer, info in by_peer.items()
            if peer != me and peer not in gone and info.state != ServerState.OFFLINE)
        for by_peer in block_servers
    ]


def to_check(block_servers: Sequence[Mapping[str, ServerInfo]], me: str,
             watch_holders: int = WATCH_HOLDERS, limit: int = WATCH_PINGS) -> list[str]:
    """The servers worth asking whether they are still there: the others holding a block that has fewer than
    `watch_holders` servers (a crashed server's record stays until it expires: up to ServerConfig.expiration
    seconds in which its blocks look covered; where a block has several servers, one more or less changes
    nothing urgent, and asking them all would cost every server a ping to every other), at most `limit` of them
    (`watch_order`)."""
    fewest: dict[str, int] = {}
    for by_peer in block_servers:
        live = {peer for peer, info in by_peer.items() if info.state != ServerState.OFFLINE}
        if len(live) < watch_holders:
            for peer in live - {me}:
                fewest[peer] = min(fewest.get(peer, len(live)), len(live))
    return watch_order(me, fewest, limit)


def watch_order(me: str, fewest: Mapping[str, int], limit: int = WATCH_PINGS) -> list[str]:
    """The `limit` servers a watcher `me` pings out of `fewest` (peer -> holders of its thinnest block): the holders
    of the thinnest blocks first, then an order of its own (crc32 of both peer ids), the same every round, so that
    the watchers of an evenly thin swarm share it out and each pings the same servers round after round (a silence
    is confirmed over two rounds). Every server pinging every other every watch period cost a swarm of 48 servers
    with 4 per block ~440 pings a second on one machine."""
    return sorted(fewest, key=lambda peer: (fewest[peer], zlib.crc32(f"{me} {peer}".encode())))[:max(0, limit)]


def holder_counts(block_servers: Sequence[Mapping[str, ServerInfo]]) -> list[int]:
    """Per block, how many JOINING or ONLINE servers announce it."""
    return [sum(info.state != ServerState.OFFLINE for info in by_peer.values()) for by_peer in block_servers]


def uncovered(capacity: Sequence[float]) -> bool:
    """Whether some block has no server at all (capacity 0)."""
    return any(c <= 0 for c in capacity)


def needs_watch(holders: Sequence[int], watch_holders: int = WATCH_HOLDERS) -> bool:
    """Whether to keep polling the swarm between balance checks: some block has fewer than `watch_holders`
    servers, so one departure may leave it with none (in a swarm where every block has several, the regular check
    suffices, and reading every block every few seconds would cost each server far more DHT traffic)."""
    return any(n < watch_holders for n in holders)


def join_delay(rng: random.Random, max_delay: float) -> float:
    """Seconds a starting server waits before reading the swarm: uniform(0, max_delay)."""
    return rng.uniform(0.0, max_delay)


def check_delay(rng: random.Random, period: float) -> float:
    """Seconds until the next balance check: period x uniform(0.75, 1.25), so that servers that started together
    do not decide on the same view."""
    return period * rng.uniform(0.75, 1.25)


def with_own(capacity: Sequence[float], current: tuple[int, int], share: float) -> list[float]:
    """`capacity` (others only) plus this server's `share` on its `current` blocks."""
    start, end = current
    return [c + share if start <= i < end else float(c) for i, c in enumerate(capacity)]


@dataclass(frozen=True)
class Move:
    """Go to blocks `target`; `urgent`: it covers a block no server has, and leaves none bare (no drain, no
    cooldown)."""

    target: tuple[int, int]
    urgent: bool


def settle_move(me: str, current: tuple[int, int], share: float, capacity: Sequence[float],
                joining_here: Mapping[str, tuple[int, int, float]], quality: float) -> tuple[int, int] | None:
    """Before loading: the blocks to take instead of `current`, or None to keep them.

    `capacity` is the swarm's without us; `joining_here` the other JOINING servers whose blocks overlap ours, peer
    id -> (start, end, block share): they may be deciding right now too. Alone (none of them), the move is
    should_move's. Otherwise the servers of a herd (several that read the same lagging view and took the same
    weakest window) place themselves one after another in peer-id order, each computing the same order:

    - the others' shares are taken off `capacity`; the smallest peer id keeps its blocks;
    - each next one keeps its blocks if they are still as weak as the weakest window (choose_best_blocks) with
      the ones before it placed, else takes that window;
    - we take what this gives us; the servers after us are left out (they place themselves after us).

    So of two servers that chose the same blocks the larger peer id gives way (when there is a window as weak
    elsewhere), and a herd of k spreads over k windows at once instead of one server per settle round (eight of
    48 servers took the same four blocks within 11 s at 48 servers on one machine, and moved one at a time).
    The servers before us are placed by the rule, not by what they did: one that already started loading is
    taken to have moved when the rule says it should (a rarer, smaller herd than the one avoided)."""
    if not joining_here:
        return should_move(current, share, with_own(capacity, current, share), quality)
    base = list(capacity)
    for start, end, other in joining_here.values():
        for i in range(max(0, start), min(end, len(base))):
            base[i] = max(0.0, base[i] - other)
    placed = base
    # a record's range is checked when it is read, but a window this model cannot hold is left out, not trusted
    members = sorted(p for p, (start, end, _) in joining_here.items() if p < me and 0 <= start < end <= len(base))
    for index, peer in enumerate([*members, me]):
        start, end, own = (*current, share) if peer == me else joining_here[peer]
        window = (start, end)
        if index > 0:
            best = choose_best_blocks(end - start, placed)
            if weaker(weakness(placed, best), weakness(placed, window)):
                window = best
        placed = with_own(placed, window, own)
    return None if window == current else window


def plan_move(current: tuple[int, int], share: float, capacity: Sequence[float], quality: float,
              since_last_move: float, cooldown: float) -> Move | None:
    """The move this server should make now, or None.

    `capacity`: the swarm's per-block capacity without this server (`swarm_capacity`), `share` its own per block
    (`block_share`), `since_last_move` seconds since it last moved (or started). See the module docstring.
    """
    if since_last_move < 0 or cooldown < 0:
        raise ValueError("since_last_move and cooldown must be >= 0 seconds")
    view = with_own(capacity, current, share)
    target = should_move(current, share, view, quality)
    if target is None:
        return None
    covers = any(view[i] <= 0 for i in range(*target))
    leaves_bare = any(capacity[i] <= 0 for i in range(*current) if not target[0] <= i < target[1])
    urgent = covers and not leaves_bare  # its sessions' blocks keep other servers: they can go at once
    if not urgent and since_last_move < cooldown:
        return None
    return Move(target, urgent)


def drain_seconds(move: Move, drain_timeout: float) -> float:
    """How long the mover keeps serving its open sessions before leaving their blocks: none for an urgent move,
    else up to `drain_timeout` seconds (sooner if they all end)."""
    return 0.0 if move.urgent else drain_timeout
