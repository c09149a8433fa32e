"""find_route_in, the client's hot path (a simulated saturated swarm of 1,000 servers routes ~10^6 times an hour),
against a plain rendering of its rules kept here: the same routes and the same draws from the client's generator, on
random swarms with ties (equal speeds and round trips), announced pings, bans, and 1 to 5 candidates per step."""

from __future__ import annotations

import random

import pytest

from corolla.client.swarm.route_index import PRICE_JITTER, RouteIndex, route_index
from corolla.client.swarm.routing import Span, find_route_in, one_way
from corolla.protocol.messages import ServerInfo, ServerState


def reference_draw(index: RouteIndex, start: int, end: int, rng: random.Random, candidates: int,
                   banned: frozenset[str]) -> set[str]:
    chosen: set[str] = set()
    block = start
    while block < end:
        peers, cumulative = index.draw_weights(block)
        drawn = set(peers) if len(peers) <= candidates else set(rng.choices(peers, cum_weights=cumulative,
                                                                            k=candidates))
        if banned:
            drawn = drawn - banned if drawn - banned else {peer for peer in peers if peer not in banned}
        if not drawn:
            block += 1
            continue
        chosen |= drawn
        block = max(index.servers[peer].stop for peer in drawn)
    return chosen


def reference_push(servers, holders, records, start, end, rtt, measured_rtts):
    """Layers of (block boundary, previous server) states, expanded in (cost, hops, peer) order; a state keeps the
    first predecessor that reached its (cost, hops)."""
    peers = {peer for block in range(start, end) for peer in holders.get(block, [])}
    came: list[dict[str, str]] = []
    layer: dict[str, tuple[float, int]] = {"": (0.0, 0)}
    for node in range(start, end):
        following: dict[str, tuple[float, int]] = {}
        back: dict[str, str] = {}
        for prev, (cost, hops) in sorted(layer.items(), key=lambda item: (item[1], item[0])):
            if prev and node < min(servers[prev].stop, end):
                candidate = (cost + servers[prev].per_block, hops)
                if candidate < following.get(prev, (float("inf"), 0)):
                    following[prev], back[prev] = candidate, prev
            for peer in holders.get(node, []):
                if peer != prev:
                    if not prev:
                        link = rtt(peer) / 2
                    elif records[prev].next_pings:
                        link = one_way(records, rtt, prev, peer, measured_rtts)
                    else:
                        link = rtt(prev) / 2 + rtt(peer) / 2
                    candidate = (cost + link + (servers[peer].fixed + servers[peer].per_block), hops + 1)
                    if candidate < following.get(peer, (float("inf"), 0)):
                        following[peer], back[peer] = candidate, prev
        if not following:
            return None
        came.append(back)
        layer = following
    assert peers
    peer = min(((cost + rtt(prev) / 2, hops), prev) for prev, (cost, hops) in layer.items())[1]
    spans, stop = [], end
    for block in range(end - 1, start - 1, -1):
        before = came[block - start][peer]
        if before != peer:
            spans.append(Span(peer, block, stop))
            peer, stop = before, block
    return spans[::-1]


def reference_route(index: RouteIndex, start: int, end: int, rng: random.Random, candidates: int,
                    banned: frozenset[str]) -> list[Span] | None:
    """A sampled push route, as the route_index and routing docstrings describe it."""
    holders = {b: [p for p in index.holders.get(b, []) if p not in banned] for b in range(start, end)}
    servers = index.servers
    if any(len(holders[b]) > candidates for b in range(start, end)):
        chosen = reference_draw(index, start, end, rng, candidates, banned)
        holders = {}
        for peer in sorted(chosen):
            for block in range(max(servers[peer].first, start), min(servers[peer].stop, end)):
                holders.setdefault(block, []).append(peer)
        factors = {peer: 1.0 + PRICE_JITTER * rng.random() for peer in sorted(chosen)}
        servers = {peer: type(servers[peer])(servers[peer].fixed * f, servers[peer].per_block * f, servers[peer].stop,
                                             servers[peer].first) for peer, f in factors.items()}
    return reference_push(servers, holders, index.records, start, end, index.rtt, index.rtts)


def random_view(rng: random.Random, num_servers: int, num_blocks: int) -> tuple[list[dict[str, ServerInfo]], dict]:
    peers = [f"p{i:03d}" for i in range(num_servers)]
    records = {}
    for peer in peers:
        length = rng.randint(1, min(num_blocks, rng.choice([2, 4, 8, num_blocks])))
        start = rng.randint(0, num_blocks - length)
        pings = {p: rng.choice([0.01, rng.uniform(0.001, 0.2)]) for p in rng.sample(peers, min(3, len(peers)))} \
            if rng.random() < 0.2 else {}
        records[peer] = ServerInfo(
            state=ServerState.ONLINE if rng.random() < 0.95 else ServerState.JOINING, start_block=start,
            end_block=start + length, throughput=rng.choice([100.0, 200.0, rng.uniform(10, 1000)]),
            cache_tokens_total=1000, cache_tokens_free=rng.choice([0, 1000]), torch_dtype="float32", version="0",
            protocol_version=1, max_session_length=4096, next_pings=pings, queued=rng.choice([0, 0, 1]),
            step_seconds=rng.choice([0.0, 0.01]))
    blocks = [{p: i for p, i in records.items() if i.start_block <= b < i.end_block} for b in range(num_blocks)]
    rtts = {peer: rng.choice([0.02, rng.uniform(0.001, 0.2)]) for peer in peers if rng.random() < 0.8}
    return blocks, rtts


@pytest.mark.parametrize("seed", range(40))
def test_a_sampled_push_route_and_its_draws_equal_the_plain_rendering_of_the_rules(seed):
    rng = random.Random(seed)
    num_blocks = rng.choice([1, 3, 8, 20])
    blocks, rtts = random_view(rng, rng.choice([2, 10, 40, 120]), num_blocks)
    index = route_index(blocks, 0, num_blocks, cache_tokens_needed=500, rtts=rtts, default_rtt=0.05)
    peers = sorted({peer for servers in blocks for peer in servers})
    for call in range(10):
        start = 0 if call < 3 else rng.randrange(num_blocks)
        end = num_blocks if call < 3 else rng.randint(start + 1, num_blocks)
        banned = frozenset(rng.sample(peers, min(len(peers), rng.choice([0, 1, 5]))))
        candidates = rng.choice([1, 2, 2, 5])
        ours, theirs = random.Random(call), random.Random(call)
        route = find_route_in(index, start, end, push=True, rng=ours, candidates=candidates, banned=banned)
        assert route == reference_route(index, start, end, theirs, candidates, banned)
        assert ours.getstate() == theirs.getstate()  # the same numbers drawn from the client's generator
