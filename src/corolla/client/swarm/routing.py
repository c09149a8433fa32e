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
from typing import Collection, Mapping, Sequence

from corolla.client.swarm.push_routing import (  # noqa: F401 (believed_ping, one_way: used from here)
    believed_ping, find_push_route, one_way,
)
from corolla.client.swarm.route_index import (  # noqa: F401 (ANNOUNCED_SPEEDUP, usable_servers: used from here)
    ANNOUNCED_SPEEDUP, CANDIDATES_PER_BLOCK, PRICE_JITTER, RouteIndex, Span, _jittered, _restricted,
    believed_throughput, check_range, draw_candidates, route_index, usable_servers,
)
from corolla.protocol.messages import ServerInfo


def measured_speed(seconds: float, rtt: float | None, blocks: int, tokens: int) -> float | None:
    """The throughput (tokens/s per block, the unit servers announce) a step shows: `tokens` through `blocks` blocks
    in `seconds` as the client saw it, less the client's round trip to the server (`rtt`, None: unknown). None when
    the step took no longer than the round trip (it tells nothing about compute) or the arguments are degenerate."""
    compute = seconds - (rtt or 0.0)
    if blocks <= 0 or tokens <= 0 or not compute > 0:
        return None
    return blocks * tokens / compute


def with_codec(block_servers: list[dict[str, ServerInfo]], codec: str) -> list[dict[str, ServerInfo]]:
    """Each block's servers that take activations in `codec` (ServerInfo.codecs; every server takes "none")."""
    if codec == "none":
        return block_servers
    return [{peer: info for peer, info in servers.items() if codec in info.codecs} for servers in block_servers]


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
    rng: random.Random | None = None,
    candidates: int = CANDIDATES_PER_BLOCK,
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
    client's measurements allow (see the module docstring). Servers are priced by their announced load too
    (`block_price`, QUEUED_SESSION_COST). With an `rng`, the route goes through a sample of the swarm drawn with it
    (`draw_candidates`, `candidates` draws per step): pass the client's own generator, so that clients reading the
    same view spread over near-cheapest servers. Ties are broken towards fewer hops, then by peer id, so equal
    inputs (and equal `rng` states) give equal routes.
    """
    index = route_index(block_servers, start, end, banned=banned, cache_tokens_needed=cache_tokens_needed,
                        hop_cost=hop_cost, rtts=rtts, default_rtt=default_rtt, adapter=adapter,
                        allowed_quant=allowed_quant, relay_cost=relay_cost, measured=measured)
    return find_route_in(index, start, end, push=push, rng=rng, candidates=candidates)


def find_route_in(index: RouteIndex, start: int, end: int, *, push: bool = False, rng: random.Random | None = None,
                  candidates: int = CANDIDATES_PER_BLOCK, banned: Collection[str] = frozenset()
                  ) -> list[Span] | None:
    """`find_route` over a prebuilt `route_index` (which must cover [start, end)): the cheapest route through all
    of its servers but `banned` ones, or, with an `rng`, through those `draw_candidates` draws."""
    if not index.start <= start < end <= index.end:
        raise ValueError(f"blocks {start}:{end} are outside the index's {index.start}:{index.end}")
    servers, records, rtts = index.servers, index.records, index.rtts
    holders: Mapping[int, list[str]] = index.holders
    if rng is not None and _more_than(holders, start, end, candidates, banned):
        chosen = sorted(draw_candidates(index, start, end, rng, candidates, banned))
        holders = _restricted(index, start, end, chosen)
        # each drawn server's price x uniform(1, 1 + PRICE_JITTER): servers within a few percent of each other
        # share sessions instead of the lowest peer id taking them all
        servers = {peer: _jittered(servers[peer], 1.0 + PRICE_JITTER * rng.random()) for peer in chosen}
        if push:
            return find_push_route(servers, holders, records, start, end, index.rtt, rtts, chosen)
    elif banned:
        holders = {b: [p for p in holders.get(b, []) if p not in banned] for b in range(start, end)}
    if push:
        return find_push_route(servers, holders, records, start, end, index.rtt, rtts)
    default_rtt = index.default_rtt

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
                 for nxt in range(node + 1, min(server.stop, end) + 1)]
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


def _more_than(holders: Mapping[int, list[str]], start: int, end: int, candidates: int, banned: Collection[str]
               ) -> bool:
    """Whether some block of [start, end) has more than `candidates` holders that are not `banned`."""
    for block in range(start, end):
        peers = holders.get(block, ())
        if len(peers) > candidates + len(banned):
            return True  # whichever of them are banned, enough are left
        if len(peers) > candidates and sum(peer not in banned for peer in peers) > candidates:
            return True
    return False


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
    check_range(block_servers, start, end)
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


def whole_span_view(block_servers: Sequence[Mapping[str, ServerInfo]], start: int, end: int
                    ) -> list[dict[str, ServerInfo]]:
    """`block_servers` with only the servers that hold every block of [start, end) (their records as read): the view
    in which any route over [start, end) is one server. Standby replicas (client.chain.standby) are routed in it."""
    whole = set(block_servers[start]) if start < end else set()
    for b in range(start + 1, end):
        whole &= set(block_servers[b])
    return [{peer: info for peer, info in servers.items() if peer in whole} for servers in block_servers]
