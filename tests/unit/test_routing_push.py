"""Push routing (find_route(push=True)): one-way legs client -> first, server -> server (announced next_pings, else
through the client), last -> client; exact routes, fallbacks, hostile records, determinism, a brute-force check
and the time it takes on a swarm of 100 servers and 100 blocks."""

from __future__ import annotations

import asyncio
import itertools
import random
import time

import pytest
from pydantic import ValidationError

from corolla.client.swarm.routing import Span, find_route, one_way
from corolla.protocol.messages import MAX_NEXT_PINGS, ServerInfo
from test_routing import make_info, make_manager, swarm


def with_pings(info: ServerInfo, **pings: float) -> ServerInfo:
    return info.model_copy(update={"next_pings": pings})


def close_pair_far_from_client(pinged: bool = True) -> tuple[list[dict[str, ServerInfo]], dict[str, float]]:
    """a (0:2) and b (2:4): fast, 50 ms from the client, 2 ms from each other; c (0:4): slow, 10 ms from the client."""
    a = make_info(0, 2, throughput=1000)
    servers = {"a": with_pings(a, b=0.002) if pinged else a, "b": make_info(2, 4, throughput=1000),
               "c": make_info(0, 4, throughput=50)}
    return swarm(4, servers), {"a": 0.05, "b": 0.05, "c": 0.01}


def test_push_routing_takes_two_servers_close_to_each_other_that_relay_routing_avoids():
    blocks, rtts = close_pair_far_from_client()
    # relay: a+b = 2 * (0.002 + 0.05) + 4 * 0.001 = 0.108 s, c = 0.002 + 0.01 + 4 * 0.02 = 0.092 s
    assert find_route(blocks, 0, 4, rtts=rtts) == [Span("c", 0, 4)]
    # push: a+b = 0.025 + (0.002 + 0.002) + 0.001 + (0.002 + 0.002) + 0.025 = 0.059 s, c = 0.005 + 0.082 + 0.005
    assert find_route(blocks, 0, 4, rtts=rtts, push=True) == [Span("a", 0, 2), Span("b", 2, 4)]


@pytest.mark.parametrize("stretch, overhead", [(1.0, 0.0), (2.0, 0.0), (2.0, 0.01), (1.0, 0.03)])
def test_the_emulated_hosts_of_test_wan_routing_route_push_through_b_and_c_and_relay_through_a(stretch, overhead):
    """tests/net/test_wan_routing.py's swarm: a (0:4) 40 ms one way from the client, b (0:2) and c (2:4) 25 ms, b
    1 ms from c, all at 100 tokens/s. Pings there measure every round trip `stretch` times plus `overhead` s
    (stream opening, processing): the routes must not depend on either."""
    measured = lambda one_way_s: stretch * 2 * one_way_s + overhead  # noqa: E731
    b = with_pings(make_info(0, 2), c=measured(0.001), a=measured(0.055))
    blocks = swarm(4, {"a": make_info(0, 4), "b": b, "c": make_info(2, 4)})
    rtts = {"a": measured(0.040), "b": measured(0.025), "c": measured(0.025)}
    assert find_route(blocks, 0, 4, rtts=rtts) == [Span("a", 0, 4)]
    assert find_route(blocks, 0, 4, rtts=rtts, push=True) == [Span("b", 0, 2), Span("c", 2, 4)]
    # until b announces c, its hop is priced through the client and a stays the push route too
    unpinged = swarm(4, {"a": make_info(0, 4), "b": make_info(0, 2), "c": make_info(2, 4)})
    assert find_route(unpinged, 0, 4, rtts=rtts, push=True) == [Span("a", 0, 4)]


def test_an_unmeasured_hop_is_charged_the_way_through_the_client():
    blocks, rtts = close_pair_far_from_client(pinged=False)
    # a -> b not announced: (0.05 + 0.05) / 2, so a+b = 0.025 + 0.004 + 0.05 + 0.004 + 0.025 = 0.108 s > c's 0.092 s
    assert find_route(blocks, 0, 4, rtts=rtts, push=True) == [Span("c", 0, 4)]
    records = {peer: info for servers in blocks for peer, info in servers.items()}
    rtt = {"a": 0.05, "b": 0.03}.get
    assert one_way(records, lambda p: rtt(p, 0.1), "a", "b") == pytest.approx(0.04)
    assert one_way(records, lambda p: rtt(p, 0.1), "a", "c") == pytest.approx(0.075)  # c unmeasured: default 0.1
    pinged = {"a": with_pings(records["a"], b=0.002)}
    assert one_way(pinged, lambda p: 1.0, "a", "b") == pytest.approx(0.001)


def test_unmeasured_servers_are_charged_the_default_round_trip_in_push_routes():
    blocks = swarm(2, {"new": make_info(0, 2), "known": make_info(0, 2)})
    assert find_route(blocks, 0, 2, rtts={"known": 0.01}, default_rtt=0.05, push=True) == [Span("known", 0, 2)]
    assert find_route(blocks, 0, 2, rtts={"known": 0.01}, default_rtt=0.0, push=True) == [Span("new", 0, 2)]


def test_a_single_span_costs_the_same_in_push_and_relay_routing():
    blocks = swarm(4, {"near": make_info(0, 4, throughput=100), "far": make_info(0, 4, throughput=200)})
    for rtts, expected in [({"near": 0.001, "far": 0.05}, "near"), ({"near": 0.001, "far": 0.01}, "far")]:
        assert find_route(blocks, 0, 4, rtts=rtts, push=True) == find_route(blocks, 0, 4, rtts=rtts) == [Span(expected, 0, 4)]


def test_push_routing_keeps_the_filters_and_penalties():
    blocks, rtts = close_pair_far_from_client()
    assert find_route(blocks, 0, 4, rtts=rtts, push=True, banned={"b"}) in (
        [Span("a", 0, 2), Span("c", 2, 4)], [Span("c", 0, 4)])
    assert find_route(blocks, 0, 4, rtts=rtts, push=True, banned={"c", "b"}) is None
    relayed = {"a": with_pings(make_info(0, 2, 1000).model_copy(update={"relayed": True}), b=0.002),
               "b": make_info(2, 4, 1000), "c": make_info(0, 4, 50)}
    assert find_route(swarm(4, relayed), 0, 4, rtts=rtts, push=True, relay_cost=0.05) == [Span("c", 0, 4)]
    full = {"a": with_pings(make_info(0, 2, 1000, free=10), b=0.002), "b": make_info(2, 4, 1000), "c": make_info(0, 4, 50)}
    assert find_route(swarm(4, full), 0, 4, rtts=rtts, push=True, cache_tokens_needed=100) == [Span("c", 0, 4)]
    nf4 = {"a": with_pings(make_info(0, 2, 1000).model_copy(update={"quant": "nf4"}), b=0.002),
           "b": make_info(2, 4, 1000), "c": make_info(0, 4, 50)}
    assert find_route(swarm(4, nf4), 0, 4, rtts=rtts, push=True, allowed_quant=("none",)) == [Span("c", 0, 4)]
    lora = {"a": with_pings(make_info(0, 2, 1000).model_copy(update={"adapters": ("x",)}), b=0.002),
            "b": make_info(2, 4, 1000).model_copy(update={"adapters": ("x",)}), "c": make_info(0, 4, 50)}
    assert find_route(swarm(4, lora), 0, 4, rtts=rtts, push=True, adapter="x") == [Span("a", 0, 2), Span("b", 2, 4)]
    assert find_route(swarm(4, lora), 0, 4, rtts=rtts, push=True, adapter="y") is None


def test_push_routes_are_deterministic_fewer_hops_then_lower_peer_id():
    # all free of cost but compute: a+b = 0.02 + 0.02 = 0.04 s = c and d alone; c wins (one hop, lower id than d)
    servers = {"d": make_info(0, 4), "a": make_info(0, 2), "c": make_info(0, 4), "b": make_info(2, 4)}
    for order in itertools.permutations(servers):
        blocks = swarm(4, {peer: servers[peer] for peer in order})
        assert find_route(blocks, 0, 4, hop_cost=0.0, push=True) == [Span("c", 0, 4)]


def test_hostile_next_pings_are_refused_when_the_record_is_read():
    record = make_info(0, 2).model_dump(mode="json")
    for bad in [{"b": -0.1}, {"b": float("nan")}, {"b": float("inf")}, {"b": 1e9}, {"": 0.1}, {"b": "fast"},
                {"x" * 200: 0.1}, {f"p{i}": 0.01 for i in range(MAX_NEXT_PINGS + 1)}]:
        with pytest.raises(ValidationError):
            ServerInfo.model_validate({**record, "next_pings": bad})


def test_pings_a_server_announces_to_itself_or_to_unknown_peers_change_nothing():
    blocks, rtts = close_pair_far_from_client(pinged=False)
    liar = {**blocks[0]["a"].model_dump(), "next_pings": {"a": 0.0, "zz": 0.0}}
    blocks = swarm(4, {"a": ServerInfo.model_validate(liar), "b": blocks[2]["b"], "c": blocks[0]["c"]})
    assert find_route(blocks, 0, 4, rtts=rtts, push=True) == [Span("c", 0, 4)]


def push_cost(route: list[Span], records: dict[str, ServerInfo], rtts: dict[str, float], hop_cost: float) -> float:
    """What a push route costs, added up leg by leg as the module docstring prices it."""
    rtt = rtts.__getitem__
    cost = rtt(route[0].peer_id) / 2 + rtt(route[-1].peer_id) / 2
    for i, span in enumerate(route):
        cost += hop_cost + span.length / records[span.peer_id].throughput
        if i:
            cost += one_way(records, rtt, route[i - 1].peer_id, span.peer_id, rtts)  # pings as the client believes them
    return cost


def all_routes(records: dict[str, ServerInfo], start: int, end: int):
    """Every chain of spans tiling [start, end) (a server never follows itself)."""
    if start == end:
        yield []
        return
    for peer, info in sorted(records.items()):
        if info.start_block <= start < info.end_block:
            for stop in range(start + 1, min(info.end_block, end) + 1):
                for rest in all_routes(records, stop, end):
                    if not rest or rest[0].peer_id != peer:
                        yield [Span(peer, start, stop), *rest]


def random_swarm(rng: random.Random, num_servers: int, num_blocks: int, max_span: int) -> dict[str, ServerInfo]:
    records = {}
    for i in range(num_servers):
        start = rng.randrange(num_blocks)
        records[f"p{i:03d}"] = make_info(start, min(num_blocks, start + rng.randint(1, max_span)), rng.uniform(50, 500))
    for peer, info in records.items():
        after = [p for p, o in records.items() if o.start_block <= info.end_block < o.end_block]
        records[peer] = with_pings(info, **{p: rng.uniform(0.001, 0.1) for p in rng.sample(after, min(len(after), 3))})
    return records


@pytest.mark.parametrize("seed", range(20))
def test_push_route_is_the_cheapest_of_all_routes_of_a_small_random_swarm(seed):
    rng = random.Random(seed)
    records = random_swarm(rng, 6, 6, 4)
    blocks = swarm(6, records)
    rtts = {peer: rng.uniform(0.005, 0.2) for peer in records}
    route = find_route(blocks, 0, 6, rtts=rtts, push=True)
    costs = [push_cost(r, records, rtts, 0.002) for r in all_routes(records, 0, 6)]
    if not costs:
        assert route is None
        return
    assert route is not None and push_cost(route, records, rtts, 0.002) == pytest.approx(min(costs), abs=1e-12)


def test_push_routing_over_100_servers_and_100_blocks_is_fast():
    rng = random.Random(0)
    records = random_swarm(rng, 100, 100, 30)
    records["whole"] = make_info(0, 100, throughput=1.0)  # every block covered
    blocks = swarm(100, records)
    rtts = {peer: rng.uniform(0.005, 0.2) for peer in records}
    begin = time.perf_counter()
    route = find_route(blocks, 0, 100, rtts=rtts, push=True)
    elapsed = time.perf_counter() - begin
    assert route is not None and route[0].start == 0 and route[-1].end == 100
    assert all(a.end == b.start for a, b in zip(route, route[1:]))
    assert elapsed < 0.5, f"{elapsed:.2f} s"
    dense = swarm(100, {f"q{i:03d}": make_info(0, 100) for i in range(100)})  # the worst case: all hold all
    begin = time.perf_counter()
    assert find_route(dense, 0, 100, rtts=rtts, push=True) == [Span("q000", 0, 100)]
    assert time.perf_counter() - begin < 5.0


def test_a_push_session_routes_with_push_costs_and_a_relay_session_with_relay_costs():
    blocks, rtts = close_pair_far_from_client()
    servers = {peer: info for by_peer in blocks for peer, info in by_peer.items()}
    for push, expected in [(True, [Span("a", 0, 2), Span("b", 2, 4)]), (False, [Span("c", 0, 4)])]:
        manager = make_manager(servers, 4, push=push, hop_cost=0.002)
        manager.rtts = dict(rtts)
        assert asyncio.run(manager.make_route(0, 4)) == expected
        assert asyncio.run(manager.make_route(0, 4, push=not push)) != expected
