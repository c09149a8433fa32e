"""Route finding over announced records: exact routes for given throughputs, bans and cache room."""

from __future__ import annotations

import pytest

from corolla.client.routing import Span, find_route, uncovered_blocks
from corolla.protocol.messages import ServerInfo, ServerState


def make_info(start: int, end: int, throughput: float = 100.0, free: int = 1000, state: ServerState = ServerState.ONLINE) -> ServerInfo:
    return ServerInfo(
        state=state, start_block=start, end_block=end, throughput=throughput, cache_tokens_total=1000,
        cache_tokens_free=free, torch_dtype="float32", version="0", protocol_version=1, max_session_length=4096,
    )


def swarm(num_blocks: int, servers: dict[str, ServerInfo]) -> list[dict[str, ServerInfo]]:
    return [{p: i for p, i in servers.items() if i.start_block <= b < i.end_block} for b in range(num_blocks)]


def test_route_prefers_one_long_span_over_two_hops():
    blocks = swarm(4, {"a": make_info(0, 2), "b": make_info(2, 4), "c": make_info(0, 4)})
    assert find_route(blocks, 0, 4) == [Span("c", 0, 4)]


def test_route_avoids_a_slow_server_when_faster_ones_cover_its_blocks():
    blocks = swarm(4, {"slow": make_info(0, 4, throughput=1.0), "a": make_info(0, 2, 1000), "b": make_info(2, 4, 1000)})
    assert find_route(blocks, 0, 4) == [Span("a", 0, 2), Span("b", 2, 4)]


def test_route_skips_banned_and_offline_servers():
    blocks = swarm(4, {"c": make_info(0, 4), "a": make_info(0, 2), "b": make_info(2, 4), "off": make_info(0, 4, 1e6, state=ServerState.OFFLINE)})
    assert find_route(blocks, 0, 4, banned={"c"}) == [Span("a", 0, 2), Span("b", 2, 4)]


def test_full_server_is_avoided_when_another_can_hold_the_session():
    blocks = swarm(2, {"full": make_info(0, 2, throughput=1000, free=10), "roomy": make_info(0, 2, throughput=10)})
    assert find_route(blocks, 0, 2, cache_tokens_needed=100) == [Span("roomy", 0, 2)]
    only_full = swarm(2, {"full": make_info(0, 2, free=10)})
    assert find_route(only_full, 0, 2, cache_tokens_needed=100) == [Span("full", 0, 2)]


def test_route_can_use_part_of_a_servers_range():
    blocks = swarm(6, {"a": make_info(0, 4), "b": make_info(3, 6)})
    route = find_route(blocks, 0, 6)
    assert route is not None and [(s.start, s.end) for s in route] in ([(0, 4), (4, 6)], [(0, 3), (3, 6)])
    assert find_route(blocks, 2, 5) in ([Span("a", 2, 4), Span("b", 4, 5)], [Span("a", 2, 3), Span("b", 3, 5)])


def test_no_route_and_uncovered_blocks_when_a_block_has_no_server():
    blocks = swarm(5, {"a": make_info(0, 2), "b": make_info(3, 5)})
    assert find_route(blocks, 0, 5) is None
    assert uncovered_blocks(blocks, 0, 5) == [2]


def test_bad_range_raises():
    with pytest.raises(ValueError):
        find_route(swarm(2, {}), 1, 1)
