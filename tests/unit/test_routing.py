"""Route finding over announced records: exact routes for given throughputs, bans and cache room."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from corolla.client.config import ClientConfig
from corolla.client.swarm.routing import Span, find_route, sample_route, uncovered_blocks
from corolla.client.swarm.sequence_manager import SequenceManager
from corolla.protocol.errors import AllocationFailed, MissingBlocks, PeerUnavailable, PeerUnreachable, RemoteError
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


def test_measured_round_trips_steer_the_route():
    blocks = swarm(4, {"near": make_info(0, 4, throughput=100), "far": make_info(0, 4, throughput=200)})
    # compute: near 4/100 = 0.04 s, far 4/200 = 0.02 s; far's round trip of 0.05 s outweighs its faster compute
    assert find_route(blocks, 0, 4, rtts={"near": 0.001, "far": 0.05}) == [Span("near", 0, 4)]
    assert find_route(blocks, 0, 4, rtts={"near": 0.001, "far": 0.01}) == [Span("far", 0, 4)]


def test_cheapest_chain_adds_up_hops_pings_and_compute():
    servers = {
        "a": make_info(0, 2, throughput=1000), "b": make_info(2, 4, throughput=1000),  # 2 hops, fast compute
        "c": make_info(0, 4, throughput=100),  # 1 hop, 4 blocks at 10 ms each
    }
    blocks = swarm(4, servers)
    # a+b: 2 * (0.002 + 0.001) + 4 * 0.001 = 0.010 s;  c: 0.002 + 0.001 + 0.04 = 0.043 s
    assert find_route(blocks, 0, 4, rtts={"a": 0.001, "b": 0.001, "c": 0.001}) == [Span("a", 0, 2), Span("b", 2, 4)]
    # b far away: a+b = 0.005 + 0.045 = 0.050 s, c alone = 0.043 s, a then c's part = 0.005 + 0.023 = 0.028 s
    assert find_route(blocks, 0, 4, rtts={"a": 0.001, "b": 0.041, "c": 0.001}) == [Span("a", 0, 2), Span("c", 2, 4)]


def test_unmeasured_servers_are_charged_the_default_round_trip():
    blocks = swarm(2, {"new": make_info(0, 2), "known": make_info(0, 2)})
    assert find_route(blocks, 0, 2, rtts={"known": 0.01}, default_rtt=0.05) == [Span("known", 0, 2)]
    assert find_route(blocks, 0, 2, rtts={"known": 0.01}, default_rtt=0.0) == [Span("new", 0, 2)]


def test_sample_route_spreads_passes_in_proportion_to_throughput():
    blocks = swarm(4, {"slow": make_info(0, 4, throughput=10), "mid": make_info(0, 4, throughput=30),
                       "fast": make_info(0, 4, throughput=60)})
    rng = random.Random(0)
    counts = Counter(route[0].peer_id for route in (sample_route(blocks, 0, 4, rng) for _ in range(5000)))
    assert abs(counts["slow"] / 5000 - 0.1) < 0.02 and abs(counts["mid"] / 5000 - 0.3) < 0.02
    assert abs(counts["fast"] / 5000 - 0.6) < 0.02


def test_sample_route_tiles_the_range_and_skips_banned_and_offline():
    blocks = swarm(6, {"a": make_info(0, 3), "b": make_info(3, 6), "c": make_info(2, 6),
                       "off": make_info(0, 6, 1e6, state=ServerState.OFFLINE)})
    rng = random.Random(1)
    for _ in range(50):
        route = sample_route(blocks, 1, 6, rng, banned={"c"})
        assert route == [Span("a", 1, 3), Span("b", 3, 6)]
    assert sample_route(blocks, 0, 6, rng, banned={"a"}) is None


def make_manager(servers: dict[str, ServerInfo], num_blocks: int, **config) -> SequenceManager:
    manager = SequenceManager(node=None, prefix="m", num_blocks=num_blocks,  # type: ignore[arg-type]
                              config=ClientConfig(missing_blocks_wait=0.0, **config))
    manager.block_servers = swarm(num_blocks, servers)

    async def no_update(force: bool = False) -> None:
        pass

    manager.update = no_update  # type: ignore[method-assign]
    return manager


def test_a_ban_never_leaves_a_block_without_a_server_but_unreachable_peers_are_dropped():
    manager = make_manager({"a": make_info(0, 2), "b": make_info(2, 4)}, 4)
    manager.ban("b")  # failed a request: still the only server of blocks 2:4, so still used
    assert asyncio.run(manager.make_route(0, 4)) == [Span("a", 0, 2), Span("b", 2, 4)]
    manager.ban("b", unreachable=True)  # cannot be dialed: gone
    with pytest.raises(MissingBlocks) as error:
        asyncio.run(manager.make_route(0, 4))
    assert error.value.blocks == [2, 3] and "2:4" in str(error.value)


def test_banned_peer_is_avoided_while_a_replica_exists_and_forgiven_after_success():
    manager = make_manager({"a": make_info(0, 4), "b": make_info(0, 4, throughput=50)}, 4)
    manager.ban("a")
    assert asyncio.run(manager.make_route(0, 4)) == [Span("b", 0, 4)]
    manager.forgive("a")
    assert asyncio.run(manager.make_route(0, 4)) == [Span("a", 0, 4)]


def test_failure_policy_counts_retries_names_the_cause_and_skips_dead_peers_for_free():
    manager = make_manager({"a": make_info(0, 4), "b": make_info(0, 4)}, 4, max_retries=2)
    span = Span("a", 0, 4)
    assert manager.after_failure(PeerUnreachable("gone"), 0, span) == 0  # a dead peer costs no retry...
    assert "a" in manager.banned(unreachable_only=True)  # ...and is skipped from now on
    assert manager.after_failure(PeerUnavailable("stream broke"), 0, Span("b", 0, 4)) == 1
    full = RemoteError("server_full", "server full", peer="b")
    assert manager.after_failure(full, 1, Span("b", 0, 4)) == 2
    with pytest.raises(AllocationFailed, match="blocks 0:4 could hold the session after 3 attempts"):
        manager.after_failure(full, 2, Span("b", 0, 4))
    with pytest.raises(PeerUnavailable, match="blocks 0:4 failed 3 times"):
        manager.after_failure(PeerUnavailable("again"), 2, Span("b", 0, 4))
    bad = RemoteError("bad_request", "wrong shape")
    with pytest.raises(RemoteError, match="wrong shape"):  # the caller's mistake: no retry
        manager.after_failure(bad, 0, Span("b", 0, 4))


def test_a_server_that_moved_makes_the_next_update_reread_the_swarm():
    manager = make_manager({"a": make_info(0, 4)}, 4)
    assert not manager._stale
    manager.after_failure(RemoteError("not_served", "blocks 0:4 are not served here"), 0, Span("a", 0, 4))
    assert manager._stale


def test_a_server_behind_a_relay_is_charged_the_relay_cost():
    relayed = make_info(0, 4).model_copy(update={"relayed": True})
    blocks = swarm(4, {"near-relayed": relayed, "far-direct": make_info(0, 4)})
    rtts = {"near-relayed": 0.030, "far-direct": 0.040}
    assert find_route(blocks, 0, 4, rtts=rtts) == [Span("near-relayed", 0, 4)]
    assert find_route(blocks, 0, 4, rtts=rtts, relay_cost=0.02) == [Span("far-direct", 0, 4)]
    assert find_route(blocks, 0, 4, rtts=rtts, relay_cost=0.005) == [Span("near-relayed", 0, 4)]
    only_relayed = swarm(4, {"near-relayed": relayed})
    assert find_route(only_relayed, 0, 4, rtts=rtts, relay_cost=10.0) == [Span("near-relayed", 0, 4)]


def test_sequence_manager_routes_with_the_configured_relay_cost():
    manager = SequenceManager(None, "m", 4, ClientConfig(relay_cost=0.02, default_rtt=0.0))  # type: ignore[arg-type]
    manager.block_servers = swarm(4, {"a-relayed": make_info(0, 4).model_copy(update={"relayed": True}),
                                      "b-direct": make_info(0, 4)})
    manager.rtts = {"a-relayed": 0.030, "b-direct": 0.040}
    manager.last_update = float("inf")  # no DHT read
    route = asyncio.run(manager.make_route(0, 4))
    assert route == [Span("b-direct", 0, 4)]


def test_a_ping_that_gets_an_answer_lifts_an_unreachable_ban_but_not_a_misbehaviour_ban(monkeypatch):
    class Node:
        p2p = None

        async def connect(self, *args, **kwargs):
            return True

    async def answers(node, peer_id, maddrs, *, connect_timeout, timeout):
        return 0.01

    monkeypatch.setattr("corolla.client.swarm.sequence_manager.ping", answers)
    manager = SequenceManager(Node(), "m", 4, ClientConfig(unreachable_ban=60.0))  # type: ignore[arg-type]
    manager.ban("gone-then-back", unreachable=True)
    manager.ban("misbehaving")
    assert manager.banned() == {"gone-then-back", "misbehaving"}

    async def ping_both():
        await manager._ping("gone-then-back")
        await manager._ping("misbehaving")
        await manager.close()

    asyncio.run(ping_both())
    assert manager.banned() == {"misbehaving"}
    assert set(manager.rtts) == {"gone-then-back", "misbehaving"}
