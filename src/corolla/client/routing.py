"""Route finding: pure functions from announced server records to a chain of spans.

A route for blocks [start, end) is a list of spans (peer, a, b) that tile the range in order. We search the
cheapest one with Dijkstra over block boundaries: an edge a -> b exists for each server hosting [a, b), and
costs one hop overhead plus the compute time of b - a blocks at that server's throughput, plus a penalty when its
free cache cannot hold the session.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Mapping, Sequence

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


def find_route(
    block_servers: Sequence[Mapping[str, ServerInfo]],
    start: int,
    end: int,
    *,
    banned: frozenset[str] | set[str] = frozenset(),
    cache_tokens_needed: int = 0,
    hop_cost: float = 0.002,
) -> list[Span] | None:
    """Cheapest chain of spans covering [start, end), or None when some block has no usable server.

    block_servers[i] maps peer id -> record for block i (as read from the DHT). Only ONLINE servers that are not
    banned are used. Ties are broken towards fewer hops, then by peer id, so equal inputs give equal routes.
    """
    if not 0 <= start < end <= len(block_servers):
        raise ValueError(f"bad block range {start}:{end} for {len(block_servers)} blocks")
    # each server's contiguous coverage starting at each block it holds, limited to [start, end)
    edges: dict[int, list[tuple[float, str, int]]] = {}
    for block in range(start, end):
        for peer, info in block_servers[block].items():
            if peer in banned or info.state != ServerState.ONLINE:
                continue
            stop = min(info.end_block, end)
            if not (info.start_block <= block < stop):
                continue
            per_block = 1.0 / max(info.throughput, 1e-9)
            penalty = FULL_CACHE_PENALTY if info.cache_tokens_free < cache_tokens_needed else 0.0
            for b in range(block + 1, stop + 1):
                edges.setdefault(block, []).append((hop_cost + per_block * (b - block) + penalty, peer, b))

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


def uncovered_blocks(block_servers: Sequence[Mapping[str, ServerInfo]], start: int, end: int, banned: frozenset[str] | set[str] = frozenset()) -> list[int]:
    """Blocks in [start, end) with no ONLINE, unbanned server."""
    return [
        b for b in range(start, end)
        if not any(p not in banned and i.state == ServerState.ONLINE for p, i in block_servers[b].items())
    ]
