"""Petals 2.2's swarm rules, written from their documented behaviour (not from their code), for comparison.

    announce     throughput = min(forward tokens/s / ((blocks + 1) / 2), network tokens/s); forward measured on
                 1,024-token batches; network: 100 Mbit/s over hidden states of HIDDEN_SIZE 16-bit numbers. Every
                 60 s, records expire after 120 s. Placement view: per block, the summed throughput of JOINING and
                 ONLINE servers (no division by blocks held beyond the (blocks + 1) / 2 above)
    join         sleep uniform(0, 10) s, then the window whose *sorted* per-block throughputs are smallest,
                 compared element by element (ties: the earliest)              `choose_window`
    move         checked every uniform(0, 240) s: remove its own contribution (x 1.001); stay if that leaves a
                 block with none while every block had some, or if its best window is where it is; else simulate
                 it moving there and every server, in random order, re-choosing the same way until none moves;
                 move when (minimum now) / (minimum after) < 0.75 - 0.001               `should_move`
                 A move reloads every block and drops every session (no drain).
    route        min-latency over (server, block): per block 1 / single-token rate, per hop RTT/2 + 0.018 s
                 (0.15 s unknown, at most 5 s), +10 s when its free cache cannot hold the session; a route leaves a
                 server only at the end of its span; no load term                       `route`
    client       relays every hop; view refreshed every 60 s; a failing server banned 15 x 2^k s, ignored when
                 every server of a block is banned; retries wait min(2^(n-1), 60) s without limit

What this model assumes beyond those rules: each client knows a round trip to every server, off by a factor of its
own (lognormal, sigma RTT_NOISE: pinging at other moments), so that clients of one region do not all take the
very same route (Petals pings only a few servers and prices the others at 0.15 s: the assumption flatters its
routes); the simulated rebalance's minimum is computed once per 30 simulated seconds (it
depends on the swarm, hardly on which server asks; the cost of simulating it for every check of 1,000 servers would
be hours), at most 20 rounds; a user stops retrying after MAX_STALL seconds.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from corolla.client.swarm.bans import Ban, next_ban
from corolla.client.swarm.routing import Span
from corolla.protocol.messages import ServerState
from corolla.server.presence.rebalancing import Move
from corolla.sim.dht import SimDht
from corolla.sim.policy import SwarmSpans
from corolla.sim.step_cost import StepCost

HIDDEN_SIZE = 1024  # the measured block's (corolla.sim.step_cost)
ASSUMED_NETWORK_BITS = 100e6
BALANCE_QUALITY = 0.75
EPS = 1e-3
JOIN_DELAY_MEAN = 5.0
CHECK_MEAN = 120.0
HOP_FIXED = 0.018
UNKNOWN_RTT = 0.15
MAX_HOP_RTT = 5.0
NO_CACHE_PENALTY = 10.0
BAN_BASE = 15.0
MAX_RETRY_WAIT = 60.0
MAX_ROUNDS = 20  # of the simulated rebalance (Petals loops until nothing moves)
MAX_STALL = 600.0  # seconds a simulated user keeps retrying a session
RTT_NOISE = 0.25  # sigma of the log of the factor between a client's measured round trip and the true one
QUALITY_CACHE_SECONDS = 30.0


@functools.lru_cache(maxsize=256)
def _windows(total: int, blocks: int) -> np.ndarray:
    """Indices of every window of `blocks` consecutive blocks out of `total`: (starts, blocks)."""
    return np.arange(total - blocks + 1)[:, None] + np.arange(blocks)[None, :]


def choose_window(blocks: int, throughputs: Sequence[float]) -> tuple[int, int]:
    """The window of `blocks` consecutive blocks whose sorted throughputs are smallest, element by element
    (earliest on ties)."""
    values = np.asarray(throughputs, dtype=float)
    if not 0 < blocks <= len(values):
        raise ValueError(f"cannot host {blocks} blocks of a model with {len(values)}")
    windows = np.sort(values[_windows(len(values), blocks)], axis=1)  # (starts, blocks), each row ascending
    start = int(np.lexsort(windows.T[::-1])[0])  # lexsort is stable: the earliest of equal windows
    return start, start + blocks


def rebalanced_minimum(spans: Sequence[tuple[int, int, float]], num_blocks: int, rng: random.Random,
                       first: tuple[int, int, int] | None = None) -> float:
    """The swarm's minimum per-block throughput after every server, in random order, re-chose its window greedily
    until none moved (at most MAX_ROUNDS rounds). `first` = (index in spans, new start, new end): that server moves
    there before the others re-choose."""
    current = [list(span) for span in spans]
    if first is not None:
        index, start, end = first
        current[index][0], current[index][1] = start, end
    throughput = np.zeros(num_blocks)
    for start, end, value in current:
        throughput[start:end] += value
    order = list(range(len(current)))
    for _ in range(MAX_ROUNDS):
        rng.shuffle(order)
        moved = False
        for i in order:
            start, end, value = current[i]
            throughput[start:end] -= value * (1 + EPS)
            new_start, new_end = choose_window(end - start, throughput)
            throughput[start:end] += value * EPS
            if new_start != start:
                current[i][0], current[i][1] = new_start, new_end
                moved = True
            throughput[current[i][0] : current[i][1]] += value
        if not moved:
            break
    return float(throughput.min())


def should_move(current: tuple[int, int], own: float, throughputs: Sequence[float], rng: random.Random,
                rebalanced: Any) -> tuple[int, int] | None:
    """Petals' move rule (module docstring): `throughputs` per block include this server's `own` on `current`;
    `rebalanced(target)` gives the minimum after the simulated rebalance that starts with this server at `target`."""
    start, end = current
    view = np.asarray(throughputs, dtype=float)
    others = view.copy()
    others[start:end] -= own * (1 + EPS)
    if (view > 0).all() and (others[start:end] <= 0).any():
        return None  # leaving would uncover a block while every block has a server
    target = choose_window(end - start, others)
    if target == current:
        return None
    before, after = float(view.min()), rebalanced(target)
    if after <= 0:
        return None
    return target if before / after < BALANCE_QUALITY - EPS else None


@dataclass(frozen=True)
class _Holder:
    peer: str
    end: int
    per_block: float  # seconds per block (1 / single-token rate)
    free: int


class PetalsPolicy:
    name = "petals"
    relays = True
    admits_by_compute = False  # a Petals server admits while its cache has room
    opens_at_once = False  # Petals opens a route's spans one after another and keeps the ones that opened
    load_aware = False
    replays_in_short_chunks = False  # a Petals client replays a failed span's history whole
    announce_period = 60.0
    expiration = 120.0
    update_period = 60.0
    max_stall = MAX_STALL

    def __init__(self) -> None:
        self._quality_cache: dict[Any, float] = {}

    # ------------------------------------------------------------------ server
    def announced_throughput(self, cost: StepCost, speed: float, blocks: int) -> float:
        forward = 1024 / cost.prefill_seconds(1024, speed)
        network = ASSUMED_NETWORK_BITS / (HIDDEN_SIZE * 16)
        return min(forward / ((blocks + 1) / 2), network)

    def placement_share(self, throughput: float, start: int, end: int) -> float:
        return throughput

    def join_delay(self, rng: random.Random) -> float:
        return rng.uniform(0.0, 2 * JOIN_DELAY_MEAN)

    def choose(self, capacity: Sequence[float], blocks: int, rng: random.Random) -> tuple[int, int]:
        return choose_window(blocks, capacity)

    def settle_delay(self, rng: random.Random) -> float | None:
        return None  # Petals loads right after choosing

    def settle(self, me: str, current: tuple[int, int], share: float, capacity: Sequence[float],
               joining_here: Mapping[str, tuple[int, int, float]]) -> tuple[int, int] | None:
        return None

    def watch_period(self, holders: Sequence[int]) -> float | None:
        return None

    def check_delay(self, rng: random.Random) -> float:
        return rng.uniform(0.0, 2 * CHECK_MEAN)

    def plan(self, current: tuple[int, int], share: float, capacity: Sequence[float], since_last_move: float,
             rng: random.Random, swarm: SwarmSpans) -> Move | None:
        view = [c + share if current[0] <= i < current[1] else c for i, c in enumerate(capacity)]

        def rebalanced(target: tuple[int, int]) -> float:
            key = swarm.key[1]  # once per 30 simulated seconds (see the module docstring)
            if key not in self._quality_cache:
                spans = swarm.spans()
                mine = next((i for i, s in enumerate(spans) if (s[0], s[1], s[2]) == (*current, share)), None)
                first = None if mine is None else (mine, *target)
                self._quality_cache = {key: rebalanced_minimum(spans, len(capacity), rng, first)}
            return self._quality_cache[key]

        target = should_move(current, share, view, rng, rebalanced)
        return None if target is None else Move(target, urgent=False)

    def stagger(self, rng: random.Random, move: Move) -> float:
        return 0.0

    def drain(self, move: Move) -> float:
        return 0.0

    # ------------------------------------------------------------------ client
    def snapshot(self, dht: SimDht) -> list[list[_Holder]]:
        """Per block, the ONLINE servers as a Petals client prices them."""
        holders: list[list[_Holder]] = [[] for _ in range(dht.num_blocks)]
        for record in dht.records.values():
            if record.state == ServerState.ONLINE:
                holder = _Holder(record.peer, record.end, 1.0 / max(record.inference_rate, 1e-9),
                                 record.cache_free)
                for block in range(record.start, record.end):
                    holders[block].append(holder)
        return holders

    def index(self, snapshot: list[list[_Holder]], need: int, rtts: Mapping[str, float], blocks: int) -> PetalsIndex:
        return PetalsIndex(snapshot, need, rtts)

    def route(self, index: PetalsIndex, start: int, end: int, rng: random.Random,
              banned: Collection[str]) -> list[Span] | None:
        # each client measured its own round trips (module docstring): its own noise on the region's
        noise = np.random.default_rng(rng.getrandbits(64)).lognormal(0.0, RTT_NOISE, len(index.peers))
        return index.route(start, end, noise, banned)

    def ban(self, previous: Ban | None, now: float, unreachable: bool) -> Ban:
        return next_ban(previous, now, BAN_BASE, float("inf"))

    def retry_delay(self, failures: int) -> float:
        return min(2.0 ** (failures - 1), MAX_RETRY_WAIT) if failures >= 1 else 0.0

    def gives_up(self, failures: int) -> bool:
        return False


def route(holders: Sequence[Sequence[_Holder]], start: int, end: int, need: int, rtts: Mapping[str, float],
          banned: Collection[str]) -> list[Span] | None:
    """Petals' min-latency route over [start, end) (module docstring), None when a block has no usable server."""
    best = {start: 0.0}
    previous: dict[int, tuple[int, str]] = {}
    for block in range(start, end):
        cost = best.get(block)
        if cost is None:
            continue
        for h in holders[block]:
            if h.peer in banned:
                continue
            stop = min(h.end, end)
            hop = min(rtts.get(h.peer, UNKNOWN_RTT), MAX_HOP_RTT) / 2 + HOP_FIXED
            total = cost + hop + (stop - block) * h.per_block + (NO_CACHE_PENALTY if h.free < need else 0.0)
            if total < best.get(stop, float("inf")):
                best[stop] = total
                previous[stop] = (block, h.peer)
    if end not in previous:
        return None
    spans, block = [], end
    while block != start:
        prev, peer = previous[block]
        spans.append(Span(peer, prev, block))
        block = prev
    return spans[::-1]


class PetalsIndex:
    """Petals' routes over one view, vectorized (`route` is the same rule written plainly). Every (block, holder)
    pair of the view is an entry of flat arrays, in block order: the holder's peer index, span end, seconds per
    block and no-cache penalty.

    A route's edges from a block all add the same cost so far, so which holder is cheapest to each stop does not
    depend on it: one pass over the entries prices every edge and keeps, per (block, stop), the cheapest (the first
    of equal ones, as the plain rule's stable sort does); the shortest path then walks those few edges in block
    order. Sums are added in another order than the plain rule's (edge, then cost so far): routes can differ only
    where two costs are equal to the last bit."""

    def __init__(self, holders: Sequence[Sequence[_Holder]], need: int, rtts: Mapping[str, float]):
        self.peers = sorted({h.peer for block in holders for h in block})
        number = {peer: i for i, peer in enumerate(self.peers)}
        self.rtt = np.array([min(rtts.get(peer, UNKNOWN_RTT), MAX_HOP_RTT) for peer in self.peers])
        entries = [(block, number[h.peer], h.end, h.per_block, NO_CACHE_PENALTY if h.free < need else 0.0)
                   for block, held in enumerate(holders) for h in held]
        columns = list(zip(*entries)) if entries else [(), (), (), (), ()]
        self.block = np.array(columns[0], dtype=np.int64)
        self.peer = np.array(columns[1], dtype=np.int64)
        self.end = np.array(columns[2], dtype=np.int64)
        self.per_block = np.array(columns[3], dtype=float)
        self.penalty = np.array(columns[4], dtype=float)
        self.first = np.searchsorted(self.block, np.arange(len(holders) + 1))  # block b: first[b]:first[b + 1]
        self.num_blocks = len(holders)
        self.compute = (self.end - self.block) * self.per_block  # seconds of its span, for routes to the last block

    def route(self, start: int, end: int, noise: np.ndarray, banned: Collection[str]) -> list[Span] | None:
        """Petals' min-latency route over [start, end) with the client's round trips rtt x noise; None when some
        block has no usable server."""
        hop = np.minimum(self.rtt * noise, MAX_HOP_RTT) / 2 + HOP_FIXED
        if banned:
            hop = hop.copy()
            for i, peer in enumerate(self.peers):
                if peer in banned:
                    hop[i] = np.inf
        lo, hi = int(self.first[start]), int(self.first[end])
        blocks, peers = self.block[lo:hi], self.peer[lo:hi]
        if end == self.num_blocks:  # every span ends within the route
            stops, compute = self.end[lo:hi], self.compute[lo:hi]
        else:
            stops = np.minimum(self.end[lo:hi], end)
            compute = (stops - blocks) * self.per_block[lo:hi]
        costs = hop[peers] + compute + self.penalty[lo:hi]
        width = end - start + 1
        group = (blocks - start) * width + (stops - start)  # (block, stop), block-major
        cheapest = np.full((end - start) * width, np.inf)
        np.minimum.at(cheapest, group, costs)
        winner = np.full(len(cheapest), len(costs))
        at_min = costs == cheapest[group]
        if banned:
            at_min &= np.isfinite(costs)
        at_min = np.flatnonzero(at_min)
        np.minimum.at(winner, group[at_min], at_min)
        edges = np.flatnonzero(winner < len(costs))
        best = [np.inf] * width
        best[0] = 0.0
        came: list[tuple[int, int] | None] = [None] * width  # per boundary: (block it came from, peer index)
        for block, stop, cost, peer in zip((edges // width).tolist(), (edges % width).tolist(),
                                           cheapest[edges].tolist(), peers[winner[edges]].tolist()):
            total = best[block] + cost
            if total < best[stop]:
                best[stop], came[stop] = total, (block, peer)
        if came[width - 1] is None:
            return None
        spans, boundary = [], width - 1
        while boundary != 0:
            block, peer = came[boundary]
            spans.append(Span(self.peers[peer], block + start, boundary + start))
            boundary = block
        return spans[::-1]
