"""Load-aware routes: servers priced by their announced load, and clients sampling the swarm (power of d choices)."""

from __future__ import annotations

import random
from collections import Counter

from corolla.client.swarm.route_index import block_price, draw_candidates, route_index
from corolla.client.swarm.routing import Span, find_route, find_route_in
from corolla.protocol.messages import ServerInfo, ServerState


def make_info(start: int, end: int, throughput: float = 100.0, step_seconds: float = 0.0, queued: int = 0,
              sessions: int = 0) -> ServerInfo:
    return ServerInfo(
        state=ServerState.ONLINE, start_block=start, end_block=end, throughput=throughput, cache_tokens_total=1000,
        cache_tokens_free=1000, torch_dtype="float32", version="0", protocol_version=1, max_session_length=4096,
        step_seconds=step_seconds, queued=queued, sessions=sessions,
    )


def swarm(num_blocks: int, servers: dict[str, ServerInfo]) -> list[dict[str, ServerInfo]]:
    return [{p: i for p, i in servers.items() if i.start_block <= b < i.end_block} for b in range(num_blocks)]


def test_a_block_costs_its_announced_step_time_when_that_is_more_than_its_idle_compute():
    assert block_price(make_info(0, 2, throughput=100.0)) == 0.01
    assert block_price(make_info(0, 2, throughput=100.0, step_seconds=0.05)) == 0.05
    assert block_price(make_info(0, 2, throughput=100.0, step_seconds=0.001)) == 0.01
    assert block_price(make_info(0, 2, throughput=1000.0), measured=10.0) == 0.05  # believed: 2 x measured


def test_a_busy_fast_server_loses_sessions_to_an_idle_slower_one():
    idle = {"busy": make_info(0, 4, throughput=1000.0), "idle": make_info(0, 4, throughput=200.0)}
    assert find_route(swarm(4, idle), 0, 4) == [Span("busy", 0, 4)]
    loaded = {**idle, "busy": make_info(0, 4, throughput=1000.0, step_seconds=0.02)}
    assert find_route(swarm(4, loaded), 0, 4) == [Span("idle", 0, 4)]


def test_sessions_waiting_for_cache_room_make_a_server_dearer():
    servers = {"a": make_info(0, 2, queued=2), "b": make_info(0, 2, throughput=50.0)}
    assert find_route(swarm(2, servers), 0, 2) == [Span("b", 0, 2)]
    assert find_route(swarm(2, {**servers, "a": make_info(0, 2)}), 0, 2) == [Span("a", 0, 2)]


def test_clients_sharing_one_view_spread_over_equal_servers_when_they_sample():
    servers = {f"s{i:02d}": make_info(0, 4) for i in range(20)}
    view = swarm(4, servers)
    assert {tuple(find_route(view, 0, 4, push=True)) for _ in range(5)} == {(Span("s00", 0, 4),)}  # no rng: one route
    rng = random.Random(0)
    firsts = Counter(find_route(view, 0, 4, push=True, rng=rng)[0].peer_id for _ in range(200))
    assert len(firsts) == 20 and max(firsts.values()) <= 30  # every server used, none by more than 15%


def test_sampling_keeps_a_blocks_only_server_and_never_makes_a_route_impossible():
    servers = {f"s{i:02d}": make_info(0, 3) for i in range(10)} | {"only": make_info(3, 4)}
    servers |= {f"t{i:02d}": make_info(4, 6) for i in range(10)}
    view = swarm(6, servers)
    rng = random.Random(1)
    for _ in range(50):
        route = find_route(view, 0, 6, rng=rng)
        assert route is not None and Span("only", 3, 4) in route
    index = route_index(view, 0, 6)
    chosen = draw_candidates(index, 0, 6, random.Random(2), candidates=3)
    assert "only" in chosen and len(chosen) <= 7  # 3 draws at block 0, the only holder of 3, 3 draws at block 4
    assert len(draw_candidates(index, 0, 6, random.Random(2))) <= 5  # 2 draws by default


def test_a_sample_prefers_near_servers():
    servers = {f"near{i}": make_info(0, 4) for i in range(5)} | {f"far{i}": make_info(0, 4) for i in range(15)}
    rtts = {p: (0.01 if p.startswith("near") else 0.2) for p in servers}
    rng = random.Random(3)
    routes = [find_route(swarm(4, servers), 0, 4, rtts=rtts, push=True, rng=rng) for _ in range(200)]
    assert sum(r[0].peer_id.startswith("near") for r in routes) >= 150  # 3 of 4 servers are far, yet


def test_an_index_built_once_routes_like_find_route():
    servers = {"a": make_info(0, 3), "b": make_info(2, 6, throughput=300.0), "c": make_info(0, 6, throughput=40.0)}
    view = swarm(6, servers)
    index = route_index(view, 0, 6, rtts={"a": 0.01, "b": 0.02, "c": 0.001})
    for start, end in [(0, 6), (1, 5), (3, 6)]:
        for push in (False, True):
            assert find_route_in(index, start, end, push=push) == find_route(
                view, start, end, rtts={"a": 0.01, "b": 0.02, "c": 0.001}, push=push)
