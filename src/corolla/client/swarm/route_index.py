"""The swarm as route finding prices it: which servers are usable, what a block of each costs, and the sample a
client routes through (client.swarm.routing finds the route itself).

A server is usable for a block when it is ONLINE, not banned, announces the block (and the LoRA adapter and
quantization asked for, if any). Its price per block is the larger of its compute at its believed throughput
(`believed_throughput`: an announced speed is believed up to ANNOUNCED_SPEEDUP times what the client measured) and
its announced load; a span of it costs a fixed part too (the hop overhead, a penalty when its free cache cannot hold
the session or when it is reachable only through a relay, and its queue).

Load: a server announces how busy it is (ServerInfo.sessions, .queued, .step_seconds). A block of it is priced at
the larger of 1 / believed throughput and its announced `step_seconds` (what its recent decode steps took per block,
queueing behind a full batch included), so a busy server costs what it now delivers, not what it does idle; each
session it announces waiting for cache room adds QUEUED_SESSION_COST. Announcements are up to a period old, so
prices alone would send every client that reads one view to the same cheapest server. A client that passes an
`rng` therefore routes through a sample of the swarm (`draw_candidates`, the "power of d choices"): walking from
the first block, it draws `candidates` (2) holders of the block it has reached, each with probability in proportion
to how many blocks it serves per second of price from there (near, idle and long spans are drawn most), and goes
on from the farthest block they reach; the route is the cheapest one through the servers drawn, each priced up to
PRICE_JITTER higher at random (servers within a few percent of each other share sessions). A block that has a
usable server keeps one in every sample, so sampling never makes a route impossible. Measured with `corolla
simulate` (300 servers, 40 blocks): routing through all servers herded the sessions of one view onto the same
few (time per output token p99 1.5 s, against 0.9 s sampled); drawing 3 with weights cubed herded them less but
still kept the slow servers idle at saturation (0.73 of the capacity bound served, against 0.76-0.77 with 1-2
linear draws). Sampling also bounds the work: a push route over 1,000 servers took ~1 s, over a sample ~1 ms. A
session keeps the route it chose until a server on it fails.
"""

from __future__ import annotations

import math
import random
from bisect import bisect
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Iterator, NamedTuple

from corolla.protocol.messages import ServerInfo, ServerState

FULL_CACHE_PENALTY = 1e3  # seconds: use a server without room only when nothing else covers those blocks
ANNOUNCED_SPEEDUP = 2.0  # how much faster than the client measured it a server's announced throughput may be
QUEUED_SESSION_COST = 1.0  # seconds charged per session a server announces waiting for cache room
CANDIDATES_PER_BLOCK = 2  # servers drawn at each step of the candidate walk (`draw_candidates`)
DRAW_SHARPNESS = 1.0  # a holder is drawn with weight (blocks it serves per second of its price) ** this
PRICE_JITTER = 0.05  # a sampled route prices each drawn server up to this fraction higher, at random


@dataclass(frozen=True)
class Span:
    """One part of a route: server `peer_id` computes blocks [start, end)."""

    peer_id: str
    start: int
    end: int  # exclusive

    @property
    def length(self) -> int:
        return self.end - self.start


def believed_throughput(announced: float, measured: float | None, speedup: float = ANNOUNCED_SPEEDUP) -> float:
    """The throughput route finding prices a server at: the announced one, at most `speedup` x the measured one
    (None: not measured yet)."""
    return announced if measured is None else min(announced, speedup * measured)


def usable_servers(
    block_servers: Sequence[Mapping[str, ServerInfo]], block: int, banned: frozenset[str] | set[str] = frozenset(),
    adapter: str | None = None,
    allowed_quant: Collection[str] | None = None,
) -> Iterator[tuple[str, ServerInfo]]:
    """(peer, record) of every ONLINE, unbanned server whose announced range holds `block`, by peer id.

    With an `adapter`, only servers announcing that LoRA adapter count (any server can run the base model); with
    `allowed_quant`, only servers whose announced quantization is in it."""
    for peer, info in sorted(block_servers[block].items()):
        if (peer not in banned and info.state == ServerState.ONLINE and info.start_block <= block < info.end_block
                and (adapter is None or adapter in info.adapters)
                and (allowed_quant is None or info.quant in allowed_quant)):
            yield peer, info


def check_range(block_servers: Sequence[Mapping[str, ServerInfo]], start: int, end: int) -> None:
    if not 0 <= start < end <= len(block_servers):
        raise ValueError(f"bad block range {start}:{end} for {len(block_servers)} blocks")


def block_price(info: ServerInfo, measured: float | None = None) -> float:
    """Seconds a token of a new session should expect per block of this server: its compute at its believed
    throughput (`believed_throughput` with the client's `measured` speed), or its announced step_seconds (recent
    decode steps per block, queueing included) when that is more."""
    return max(1.0 / max(believed_throughput(info.throughput, measured), 1e-9), info.step_seconds)


class _Server(NamedTuple):
    """A usable server as route finding prices it (the network aside, which relay and push routes price apart). A
    named tuple, not a frozen dataclass: a sampled route builds one per drawn server (`_jittered`), and a frozen
    dataclass takes about four times as long to build."""

    fixed: float  # seconds charged per span: hop overhead, cache, queue and relay penalties
    per_block: float  # seconds per block per token (`block_price`)
    stop: int  # end of its range within the route's
    first: int  # start of its range within the route's


@dataclass
class RouteIndex:
    """The usable servers of [start, end) of one view, priced for one client: built once (`route_index`, one pass
    over the view) and routed through any number of times (`find_route_in`). Holds peer -> prices, block -> the
    peers holding it (by peer id), peer -> record, and the client's round trips."""

    start: int
    end: int
    servers: dict[str, _Server]
    holders: dict[int, list[str]]
    records: dict[str, ServerInfo]
    rtts: Mapping[str, float]
    default_rtt: float
    _draws: dict[int, tuple[list[str], list[float]]] | None = None  # block -> holders, cumulative draw weights

    def rtt(self, peer: str) -> float:
        return self.rtts.get(peer, self.default_rtt)

    def draw_weights(self, block: int) -> tuple[list[str], list[float]]:
        """Holders of `block` and their cumulative draw weights (see the module docstring), computed once."""
        if self._draws is None:
            self._draws = {}
        found = self._draws.get(block)
        if found is None:
            peers, cumulative, total = [], [], 0.0
            for peer in self.holders.get(block, []):
                server = self.servers[peer]
                reach = server.stop - block
                weight = (reach / (server.fixed + self.rtt(peer) + server.per_block * reach)) ** DRAW_SHARPNESS
                if weight > 0.0 and math.isfinite(weight):  # a round trip or price gone odd draws nothing
                    total += weight
                    peers.append(peer)
                    cumulative.append(total)
            found = self._draws[block] = (peers, cumulative)
        return found


def route_index(
    block_servers: Sequence[Mapping[str, ServerInfo]], start: int, end: int, *,
    banned: frozenset[str] | set[str] = frozenset(), cache_tokens_needed: int = 0, hop_cost: float = 0.002,
    rtts: Mapping[str, float] | None = None, default_rtt: float = 0.0, adapter: str | None = None,
    allowed_quant: Collection[str] | None = None, relay_cost: float = 0.0, measured: Mapping[str, float] | None = None,
) -> RouteIndex:
    """The usable servers of [start, end) priced for one client (arguments as `find_route`'s)."""
    check_range(block_servers, start, end)
    measured = measured or {}
    servers: dict[str, _Server] = {}
    holders: dict[int, list[str]] = {}
    records: dict[str, ServerInfo] = {}
    for block in range(start, end):
        for peer, info in usable_servers(block_servers, block, banned, adapter, allowed_quant):
            if peer not in servers:
                records[peer] = info
                free = min(info.cache_tokens_free, info.cache_tokens_total)
                fixed = hop_cost + (FULL_CACHE_PENALTY if free < cache_tokens_needed else 0.0)
                fixed += (relay_cost if info.relayed else 0.0) + QUEUED_SESSION_COST * info.queued
                servers[peer] = _Server(fixed, block_price(info, measured.get(peer)), min(info.end_block, end),
                                        max(info.start_block, start))
            elif not servers[peer].first <= block < servers[peer].stop:
                # its record under this block's key names another range than the one priced (a server that moved,
                # its old records not expired yet; or one announcing different ranges under different keys): it
                # holds, for this index, only what its first record says
                continue
            holders.setdefault(block, []).append(peer)
    return RouteIndex(start, end, servers, holders, records, rtts or {}, default_rtt)


def draw_candidates(index: RouteIndex, start: int, end: int, rng: random.Random,
                    candidates: int = CANDIDATES_PER_BLOCK, banned: Collection[str] = frozenset()) -> set[str]:
    """The servers a sampled route may go through (see the module docstring): from `start`, `candidates` draws
    among the holders of the block reached (all of them when there are no more), then on from the farthest block
    those drawn reach, until `end`. `banned` peers are never drawn (when every draw hits one, the block's other
    holders are all kept). A block with no holder is stepped over (no route exists then anyway)."""
    chosen: set[str] = set()
    servers = index.servers
    block = start
    while block < end:
        peers, cumulative = index.draw_weights(block)
        if len(peers) <= candidates:
            drawn = set(peers)
        else:
            drawn = set(_choices(rng, peers, cumulative, candidates))
        if banned:
            allowed = drawn - banned  # type: ignore[operator]
            drawn = allowed if allowed else {peer for peer in peers if peer not in banned}
        if not drawn:
            block += 1
            continue
        chosen |= drawn
        block = max(servers[peer].stop for peer in drawn)
    return chosen


def _choices(rng: random.Random, population: list[str], cum_weights: list[float], k: int) -> list[str]:
    """rng.choices(population, cum_weights=cum_weights, k=k), drawing the same numbers from `rng` and returning the
    same list (what random.Random.choices does with cum_weights, since Python 3.9), without its call overhead:
    a saturated simulated swarm draws ~10^6 times. Degenerate weights go to rng.choices, which raises."""
    total = cum_weights[-1] + 0.0
    if not (total > 0.0 and math.isfinite(total)) or len(cum_weights) != len(population):
        return rng.choices(population, cum_weights=cum_weights, k=k)
    draw, hi = rng.random, len(population) - 1
    return [population[bisect(cum_weights, draw() * total, 0, hi)] for _ in range(k)]


def _jittered(server: _Server, factor: float, _new=tuple.__new__) -> _Server:
    # tuple.__new__ straight: a third quicker than _Server(...), whose generated __new__ takes keywords (a sampled
    # route builds one per drawn server; a simulated saturated hour, millions)
    fixed, per_block, stop, first = server
    return _new(_Server, (fixed * factor, per_block * factor, stop, first))


def _restricted(index: RouteIndex, start: int, end: int, chosen: Collection[str]) -> dict[int, list[str]]:
    """block -> the peers of `chosen` holding it, by peer id (as the full index lists them)."""
    holders: dict[int, list[str]] = {}
    for peer in sorted(chosen):
        server = index.servers[peer]
        for block in range(max(server.first, start), min(server.stop, end)):
            holders.setdefault(block, []).append(peer)
    return holders
