"""Route finding: pure functions from announced server records to a chain of spans.

A route for blocks [start, end) is a list of spans (peer, a, b) that tile the range in order.

Inference routes minimise latency with Dijkstra over block boundaries: an edge a -> b exists for each server
hosting [a, b). The client relays every step between spans (client -> A -> client -> B -> client), so an edge
costs the client's measured round trip to that server, a fixed per-hop overhead, the compute time of b - a
blocks at the server's announced throughput, and a penalty when its free cache cannot hold the session. A server
reachable only through a relay costs `relay_cost` more: its measured round trip already includes the detour, but
the relay is one more machine that can fail or slow down, shared with everybody it relays for.

In push mode (`find_route(..., push=True)`) the client sends a step to the first server only, each server pushes its
output straight to the next, and the last answers the client: client -> A -> B -> C -> client. A route then costs
one-way trips, not round trips: client -> first (half the client's round trip to it), server -> next server (half
the round trip the first one announces to the second in `ServerInfo.next_pings`), last -> client (half the client's
round trip to it), plus the same per-hop overhead, compute and penalties. As the cost of a hop depends on the
server before it, Dijkstra then runs over states (block boundary, previous server). When a server has not measured
the next one, the hop is charged (rtt(client, A) + rtt(client, B)) / 2: the one-way trip through the client, an
upper bound of the direct one by the triangle inequality (where the network obeys it), so a pair known to be close
beats a pair nobody measured. Announced values are bounded when the record is read (ServerInfo).

What a server announces about itself steers routes only as far as the client's own measurements support it:
- throughput: once the client has timed steps through a server (`measured` speeds, see `measured_speed`), its
  announced throughput is believed up to ANNOUNCED_SPEEDUP times the measured one (`believed_throughput`), so a
  server announcing 1000x its speed is priced at twice what it delivers after its first step, not preferred for long;
- next_pings: a server-to-server round trip is at least |rtt(client, A) - rtt(client, B)| (triangle inequality),
  so an announced one below what the client's own round trips allow is raised to that (`believed_ping`);
- cache_tokens_free: a lie attracts sessions the server then refuses (server_full: banned and routed around), so
  it costs the liar, not the client; the value is capped at the announced total.

Forward/backward passes carry no state, so `sample_route` spreads them over servers in proportion to (believed)
throughput.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass
from typing import Callable, Collection, Iterator, Mapping, Sequence

from corolla.protocol.messages import ServerInfo, ServerState

FULL_CACHE_PENALTY = 1e3  # seconds: use a server without room only when nothing else covers those blocks
ANNOUNCED_SPEEDUP = 2.0  # how much faster than the client measured it a server's announced throughput may be


def measured_speed(seconds: float, rtt: float | None, blocks: int, tokens: int) -> float | None:
    """The throughput (tokens/s per block, the unit servers announce) a step shows: `tokens` through `blocks` blocks
    in `seconds` as the client saw it, less the client's round trip to the server (`rtt`, None: unknown). None when
    the step took no longer than the round trip (it tells nothing about compute) or the arguments are degenerate."""
    compute = seconds - (rtt or 0.0)
    if blocks <= 0 or tokens <= 0 or not compute > 0:
        return None
    return blocks * tokens / compute


def believed_throughput(announced: float, measured: float | None, speedup: float = ANNOUNCED_SPEEDUP) -> float:
    """The throughput route finding prices a server at: the announced one, at most `speedup` x the measured one
    (None: not measured yet)."""
    return announced if measured is None else min(announced, speedup * measured)


def believed_ping(announced: float, rtt_source: float | None, rtt_target: float | None) -> float:
    """A server-to-server round trip as route finding takes it: the announced one, but at least the least the
    triangle inequality allows given the client's own round trips to both (when it measured both)."""
    if rtt_source is None or rtt_target is None:
        return announced
    return max(announced, abs(rtt_source - rtt_target))


@dataclass(frozen=True)
class Span:
    peer_id: str
    start: int
    end: int  # exclusive

    @property
    def length(self) -> int:
        return self.end - self.start


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


def with_codec(block_servers: list[dict[str, ServerInfo]], codec: str) -> list[dict[str, ServerInfo]]:
    """Each block's servers that take activations in `codec` (ServerInfo.codecs; every server takes "none")."""
    if codec == "none":
        return block_servers
    return [{peer: info for peer, info in servers.items() if codec in info.codecs} for servers in block_servers]


def _check_range(block_servers: Sequence[Mapping[str, ServerInfo]], start: int, end: int) -> None:
    if not 0 <= start < end <= len(block_servers):
        raise ValueError(f"bad block range {start}:{end} for {len(block_servers)} blocks")


@dataclass(frozen=True)
class _Server:
    """A usable server as route finding prices it (the network aside, which relay and push routes price apart)."""

    fixed: float  # seconds charged per span: hop overhead, cache and relay penalties
    per_block: float  # seconds of compute per block, at its announced throughput
    stop: int  # end of its range within the route's


def _usable(
    block_servers: Sequence[Mapping[str, ServerInfo]], start: int, end: int, banned: frozenset[str] | set[str],
    cache_tokens_needed: int, hop_cost: float, adapter: str | None, allowed_quant: Collection[str] | None,
    relay_cost: float, measured: Mapping[str, float],
) -> tuple[dict[str, _Server], dict[int, list[str]], dict[str, ServerInfo]]:
    """The usable servers of [start, end): peer -> its prices (at its believed throughput), block -> the peers
    holding it (by peer id), and peer -> its record."""
    servers: dict[str, _Server] = {}
    holders: dict[int, list[str]] = {}
    records: dict[str, ServerInfo] = {}
    for block in range(start, end):
        for peer, info in usable_servers(block_servers, block, banned, adapter, allowed_quant):
            holders.setdefault(block, []).append(peer)
            if peer not in servers:
                records[peer] = info
                free = min(info.cache_tokens_free, info.cache_tokens_total)
                fixed = hop_cost + (FULL_CACHE_PENALTY if free < cache_tokens_needed else 0.0)
                fixed += relay_cost if info.relayed else 0.0
                throughput = believed_throughput(info.throughput, measured.get(peer))
                servers[peer] = _Server(fixed, 1.0 / max(throughput, 1e-9), min(info.end_block, end))
    return servers, holders, records


def find_route(
    block_servers: Sequence[Mapping[str, ServerInfo]],
    start: int,
    end: int,
    *,
    banned: frozenset[str] | set[str] = frozenset(),
    cache_tokens_needed: int = 0,
    hop_cost: float = 0.002,
    rtts: Mapping[str, float] | None = None,
    default_rtt: float = 0.0,
    adapter: str | None = None,
    allowed_quant: Collection[str] | None = None,
    relay_cost: float = 0.0,
    push: bool = False,
    measured: Mapping[str, float] | None = None,
) -> list[Span] | None:
    """Cheapest chain of spans covering [start, end), or None when some block has no usable server.

    block_servers[i] maps peer id -> record for block i (as read from the DHT). Only ONLINE servers that are not
    banned (and, given `allowed_quant`, whose announced quantization is in it) are used. `rtts` maps peer id -> the
    client's measured round trip in seconds (`default_rtt` for a peer not measured yet), `relay_cost` the extra
    seconds charged for a server that announces it is reachable only through a relay. With an `adapter`, only
    servers announcing that LoRA adapter are used. `push=True` prices the route as a push route (client -> A -> B
    -> client, with the server-to-server round trips servers announce; see the module docstring), `push=False` as
    a relayed one (a client round trip per span). `measured` maps peer id -> the throughput the client measured
    (tokens/s per block, `measured_speed`); announced throughputs and next_pings are believed only as far as the
    client's measurements allow (see the module docstring). Ties are broken towards fewer hops, then by peer id, so
    equal inputs give equal routes.
    """
    rtts = rtts or {}
    _check_range(block_servers, start, end)
    servers, holders, records = _usable(block_servers, start, end, banned, cache_tokens_needed, hop_cost, adapter,
                                        allowed_quant, relay_cost, measured or {})
    if push:
        return _push_route(servers, holders, records, start, end, lambda peer: rtts.get(peer, default_rtt), rtts)

    best: dict[int, tuple[float, int]] = {start: (0.0, 0)}
    previous: dict[int, tuple[int, str]] = {}
    heap: list[tuple[float, int, int]] = [(0.0, 0, start)]
    while heap:
        cost, hops, node = heapq.heappop(heap)
        if node == end:
            break
        if (cost, hops) > best.get(node, (float("inf"), 0)):
            continue
        edges = [(server.fixed + rtts.get(peer, default_rtt) + server.per_block * (nxt - node), peer, nxt)
                 for peer in holders.get(node, []) for server in [servers[peer]]
                 for nxt in range(node + 1, server.stop + 1)]
        for edge_cost, peer, nxt in sorted(edges, key=lambda e: (e[0], e[1], -e[2])):
            candidate = (cost + edge_cost, hops + 1)
            if candidate < best.get(nxt, (float("inf"), 0)):
                best[nxt] = candidate
                previous[nxt] = (node, peer)
                heapq.heappush(heap, (candidate[0], candidate[1], nxt))
    if end not in previous:
        return None
    spans: list[Span] = []
    node = end
    while node != start:
        prev, peer = previous[node]
        spans.append(Span(peer, prev, node))
        node = prev
    return spans[::-1]


_CLIENT = ""  # the "previous server" of a route's first span: the client (no peer id is empty)


def one_way(records: Mapping[str, ServerInfo], rtt: Callable[[str], float], source: str, target: str,
            measured_rtts: Mapping[str, float] | None = None) -> float:
    """Seconds a pushed step takes from server `source` to server `target`: half the round trip `source` announces
    to `target` (ServerInfo.next_pings; no less than `believed_ping` allows with the client's `measured_rtts`), else
    half the way through the client, (rtt(source) + rtt(target)) / 2."""
    announced = records[source].next_pings.get(target)
    if announced is not None:
        measured_rtts = measured_rtts or {}
        return believed_ping(announced, measured_rtts.get(source), measured_rtts.get(target)) / 2
    return (rtt(source) + rtt(target)) / 2


def _push_route(
    servers: Mapping[str, _Server], holders: Mapping[int, list[str]], records: Mapping[str, ServerInfo], start: int,
    end: int, rtt: Callable[[str], float], measured_rtts: Mapping[str, float],
) -> list[Span] | None:
    """Dijkstra over states (block boundary, previous server) for a push route; see the module docstring.

    A state (b, p) is "blocks [start, b) computed, the last of them by p" (p = _CLIENT at the start). From it, p
    may go on with block b (cost: its compute of one block), or the step moves to another server q holding block b
    (cost: the one-way trip p -> q, q's fixed cost and its compute of block b; one hop more). Going block by block
    keeps the work at (blocks x servers per block x servers per block), not times the spans' lengths as well. The
    state (end + 1, p) stands for "answer sent from p back to the client", so the finishing leg rtt(p) / 2 is part
    of the search and the first such state popped ends the cheapest route. Heap entries are (cost, hops, block,
    peer): equal costs go to fewer hops, then to the lower block and peer id, so the result is deterministic.
    """
    done = end + 1
    best: dict[tuple[int, str], tuple[float, int]] = {(start, _CLIENT): (0.0, 0)}
    previous: dict[tuple[int, str], tuple[int, str]] = {}
    heap: list[tuple[float, int, int, str]] = [(0.0, 0, start, _CLIENT)]

    def relax(state: tuple[int, str], cost: float, hops: int, came_from: tuple[int, str]) -> None:
        if (cost, hops) < best.get(state, (float("inf"), 0)):
            best[state] = (cost, hops)
            previous[state] = came_from
            heapq.heappush(heap, (cost, hops, *state))

    while heap:
        cost, hops, node, prev = heapq.heappop(heap)
        state = (node, prev)
        if node == done:
            return _unwind(previous, state, start)
        if (cost, hops) > best[state]:
            continue
        if node == end:
            relax((done, prev), cost + rtt(prev) / 2, hops, state)
            continue
        if prev != _CLIENT and node < servers[prev].stop:  # the same span goes on
            relax((node + 1, prev), cost + servers[prev].per_block, hops, state)
        for peer in holders.get(node, []):  # a new span starts at `node`
            if peer != prev:
                server = servers[peer]
                link = rtt(peer) / 2 if prev == _CLIENT else one_way(records, rtt, prev, peer, measured_rtts)
                relax((node + 1, peer), cost + link + server.fixed + server.per_block, hops + 1, state)
    return None


def _unwind(previous: Mapping[tuple[int, str], tuple[int, str]], final: tuple[int, str], start: int) -> list[Span]:
    """The spans of the push route whose finished state is `final`, in route order: consecutive blocks of one
    server are one span (a server never follows itself)."""
    peers: list[str] = []  # peers[i]: the server of block start + i
    state = previous[final]  # (end, last peer)
    while state[0] != start:
        peers.append(state[1])
        state = previous[state]
    peers.reverse()
    spans: list[Span] = []
    for offset, peer in enumerate(peers):
        if spans and spans[-1].peer_id == peer:
            spans[-1] = Span(peer, spans[-1].start, start + offset + 1)
        else:
            spans.append(Span(peer, start + offset, start + offset + 1))
    return spans


def sample_route(
    block_servers: Sequence[Mapping[str, ServerInfo]],
    start: int,
    end: int,
    rng: random.Random,
    *,
    banned: frozenset[str] | set[str] = frozenset(),
    adapter: str | None = None,
    allowed_quant: Collection[str] | None = None,
    measured: Mapping[str, float] | None = None,
) -> list[Span] | None:
    """A chain covering [start, end) for a stateless pass, or None when some block has no usable server.

    From the first uncovered block, a server holding it is drawn with probability proportional to its believed
    throughput (`believed_throughput` with the client's `measured` speeds) and serves as far as it reaches (up to
    `end`); so the load of many passes spreads over the servers in proportion to their speed. Deterministic for a
    given `rng` state. With an `adapter`, only servers announcing that LoRA adapter are used.
    """
    measured = measured or {}
    _check_range(block_servers, start, end)
    spans: list[Span] = []
    block = start
    while block < end:
        candidates = list(usable_servers(block_servers, block, banned, adapter, allowed_quant))
        if not candidates:
            return None
        weights = [max(believed_throughput(info.throughput, measured.get(peer)), 1e-9) for peer, info in candidates]
        peer, info = rng.choices(candidates, weights=weights)[0]
        stop = min(info.end_block, end)
        spans.append(Span(peer, block, stop))
        block = stop
    return spans


def uncovered_blocks(
    block_servers: Sequence[Mapping[str, ServerInfo]],
    start: int,
    end: int,
    banned: frozenset[str] | set[str] = frozenset(),
    adapter: str | None = None,
    allowed_quant: Collection[str] | None = None,
) -> list[int]:
    """Blocks in [start, end) with no usable (ONLINE, unbanned, with `adapter` if given, allowed quantization)
    server."""
    return [
        b
        for b in range(start, end)
        if next(usable_servers(block_servers, b, banned, adapter, allowed_quant), None) is None
    ]
