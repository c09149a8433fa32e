"""Route finding: pure functions from announced server records to a chain of spans.

A route for blocks [start, end) is a list of spans (peer, a, b) that tile the range in order.

Inference routes minimise latency with Dijkstra over block boundaries: an edge a -> b exists for each server
hosting [a, b). The client relays every step between spans (client -> A -> client -> B -> client), so an edge
costs the client's measured round trip to that server, a fixed per-hop overhead, the compute time of b - a
blocks at the server's announced throughput, and a penalty when its free cache cannot hold the session. A server
reachable only through a relay costs `relay_cost` more: its measured round trip already includes the detour, but
the relay is one more machine that can fail or slow down, shared with everybody it relays for.

Forward/backward passes carry no state, so `sample_route` spreads them over servers in proportion to throughput.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass
from typing import Collection, Iterator, Mapping, Sequence

from corolla.protocol.messages import ServerInfo, ServerState

FULL_CACHE_PENALTY = 1e3  # seconds: use a server without room only when nothing else covers those blocks


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


def _check_range(block_servers: Sequence[Mapping[str, ServerInfo]], start: int, end: int) -> None:
    if not 0 <= start < end <= len(block_servers):
        raise ValueError(f"bad block range {start}:{end} for {len(block_servers)} blocks")


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
) -> list[Span] | None:
    """Cheapest chain of spans covering [start, end), or None when some block has no usable server.

    block_servers[i] maps peer id -> record for block i (as read from the DHT). Only ONLINE servers that are not
    banned (and, given `allowed_quant`, whose announced quantization is in it) are used. `rtts` maps peer id -> the client's measured round trip in seconds (`default_rtt` for a peer
    not measured yet), `relay_cost` the extra seconds charged for a server that announces it is reachable only
    through a relay. Ties are broken towards fewer hops, then by peer id, so equal inputs give equal routes.
    With an `adapter`, only servers announcing that LoRA adapter are used.
    """
    rtts = rtts or {}
    _check_range(block_servers, start, end)
    # each server's contiguous coverage starting at each block it holds, limited to [start, end)
    edges: dict[int, list[tuple[float, str, int]]] = {}
    for block in range(start, end):
        for peer, info in usable_servers(block_servers, block, banned, adapter, allowed_quant):
            stop = min(info.end_block, end)
            per_block = 1.0 / max(info.throughput, 1e-9)
            fixed = hop_cost + rtts.get(peer, default_rtt)
            fixed += FULL_CACHE_PENALTY if info.cache_tokens_free < cache_tokens_needed else 0.0
            fixed += relay_cost if info.relayed else 0.0
            for b in range(block + 1, stop + 1):
                edges.setdefault(block, []).append((fixed + per_block * (b - block), peer, b))

    best: dict[int, tuple[float, int]] = {start: (0.0, 0)}
    previous: dict[int, tuple[int, str]] = {}
    heap: list[tuple[float, int, int]] = [(0.0, 0, start)]
    while heap:
        cost, hops, node = heapq.heappop(heap)
        if node == end:
            break
        if (cost, hops) > best.get(node, (float("inf"), 0)):
            continue
        for edge_cost, peer, nxt in sorted(edges.get(node, []), key=lambda e: (e[0], e[1], -e[2])):
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


def sample_route(
    block_servers: Sequence[Mapping[str, ServerInfo]],
    start: int,
    end: int,
    rng: random.Random,
    *,
    banned: frozenset[str] | set[str] = frozenset(),
    adapter: str | None = None,
    allowed_quant: Collection[str] | None = None,
) -> list[Span] | None:
    """A chain covering [start, end) for a stateless pass, or None when some block has no usable server.

    From the first uncovered block, a server holding it is drawn with probability proportional to its throughput
    and serves as far as it reaches (up to `end`); so the load of many passes spreads over the servers in
    proportion to their speed. Deterministic for a given `rng` state. With an `adapter`, only servers announcing
    that LoRA adapter are used.
    """
    _check_range(block_servers, start, end)
    spans: list[Span] = []
    block = start
    while block < end:
        candidates = list(usable_servers(block_servers, block, banned, adapter, allowed_quant))
        if not candidates:
            return None
        weights = [max(info.throughput, 1e-9) for _, info in candidates]
        peer, info = rng.choices(candidates, weights=weights)[0]
        stop = min(info.end_block, end)
        spans.append(Span(peer, block, stop))
        block = stop
    return spans


def uncovered_blocks(block_servers: Sequence[Mapping[str, ServerInfo]], start: int, end: int, banned: frozenset[str] | set[str] = frozenset(),
                     adapter: str | None = None, allowed_quant: Collection[str] | None = None) -> list[int]:
    """Blocks in [start, end) with no usable (ONLINE, unbanned, with `adapter` if given, allowed quantization) server."""
    return [b for b in range(start, end)
            if next(usable_servers(block_servers, b, banned, adapter, allowed_quant), None) is None]
