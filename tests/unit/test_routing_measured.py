"""Announced numbers steer routes only as far as the client's own measurements support them (client.swarm.routing):
exact prices from announced and measured values, and a lying fast server that stops being chosen after one step."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from corolla.client.config import ClientConfig
from corolla.client.swarm.routing import (ANNOUNCED_SPEEDUP, Span, believed_ping, believed_throughput, find_route,
                                    measured_speed, one_way, sample_route)
from corolla.client.swarm.sequence_manager import SequenceManager
from corolla.dht.ping import smooth
from corolla.protocol.messages import ServerInfo, ServerState


def make_info(start: int, end: int, throughput: float = 100.0, free: int = 1000, total: int = 1000,
              next_pings: dict[str, float] | None = None) -> ServerInfo:
    return ServerInfo(state=ServerState.ONLINE, start_block=start, end_block=end, throughput=throughput,
                      cache_tokens_total=total, cache_tokens_free=free, torch_dtype="float32", version="0",
                      protocol_version=1, max_session_length=4096, next_pings=next_pings or {})


def swarm(num_blocks: int, servers: dict[str, ServerInfo]) -> list[dict[str, ServerInfo]]:
    return [{p: i for p, i in servers.items() if i.start_block <= b < i.end_block} for b in range(num_blocks)]


def test_a_measured_speed_is_blocks_times_tokens_over_the_time_beyond_the_round_trip():
    assert measured_speed(0.5, 0.1, blocks=4, tokens=10) == pytest.approx(100.0)
    assert measured_speed(0.5, None, blocks=2, tokens=1) == pytest.approx(4.0)
    assert measured_speed(0.05, 0.1, blocks=4, tokens=1) is None  # no longer than the round trip: tells nothing
    assert measured_speed(0.5, 0.1, blocks=0, tokens=1) is None and measured_speed(0.5, 0.1, 4, 0) is None


def test_an_announced_throughput_is_believed_up_to_a_factor_of_the_measured_one():
    assert believed_throughput(1000.0, None) == 1000.0  # not measured yet
    assert believed_throughput(1000.0, 10.0) == 10.0 * ANNOUNCED_SPEEDUP == 20.0
    assert believed_throughput(15.0, 10.0) == 15.0  # within the factor: as announced
    assert believed_throughput(5.0, 10.0) == 5.0  # modesty is believed


def test_an_announced_ping_below_what_the_client_can_see_is_raised():
    assert believed_ping(0.0, 0.030, 0.010) == pytest.approx(0.020)  # |30 ms - 10 ms|: the triangle inequality
    assert believed_ping(0.025, 0.030, 0.010) == 0.025
    assert believed_ping(0.0, None, 0.010) == 0.0  # one of them not measured: nothing to compare with
    records = {"a": make_info(0, 2, next_pings={"b": 0.0}), "b": make_info(2, 4)}
    rtts = {"a": 0.002, "b": 0.042}
    assert one_way(records, rtts.get, "a", "b") == 0.0
    assert one_way(records, rtts.get, "a", "b", rtts) == pytest.approx(0.020)


def test_a_liars_announced_ping_stops_winning_the_push_route():
    """b1 claims a 0 ms link from a; b2 truly is 10 ms from a. The client sees b1 40 ms away and a 2 ms away, so
    a -> b1 cannot be under 38 ms: b2 wins once the client's round trips are used."""
    blocks = swarm(4, {"a": make_info(0, 2, next_pings={"b1": 0.0, "b2": 0.010}), "b1": make_info(2, 4),
                       "b2": make_info(2, 4)})
    rtts = {"a": 0.002, "b1": 0.040, "b2": 0.012}
    assert find_route(blocks, 0, 4, rtts=rtts, push=True) == [Span("a", 0, 2), Span("b2", 2, 4)]
    rtts_blind = {"a": 0.002, "b1": 0.012, "b2": 0.012}  # b1 as near as b2: its claim cannot be refuted
    assert find_route(blocks, 0, 4, rtts=rtts_blind, push=True) == [Span("a", 0, 2), Span("b1", 2, 4)]


def test_announced_free_cache_is_capped_at_the_announced_total():
    blocks = swarm(2, {"liar": make_info(0, 2, throughput=1000, free=10**9, total=10), "honest": make_info(0, 2)})
    assert find_route(blocks, 0, 2, cache_tokens_needed=100) == [Span("honest", 0, 2)]


def test_a_lying_fast_server_stops_being_chosen_after_one_step():
    """The liar announces 1000x the honest server's throughput but is 10x slower; the client routes, times the
    step through whoever it chose (as InferenceSession does), and routes again."""
    blocks = swarm(4, {"honest": make_info(0, 4, throughput=100.0), "liar": make_info(0, 4, throughput=100_000.0)})
    seconds_per_step = {"honest": 4 / 100.0 + 0.002, "liar": 4 / 10.0 + 0.002}  # 4 blocks, 1 token, 2 ms network
    rtts, speeds, chosen = {"honest": 0.002, "liar": 0.002}, {}, []
    for _ in range(6):
        [span] = find_route(blocks, 0, 4, rtts=rtts, measured=speeds)
        chosen.append(span.peer_id)
        sample = measured_speed(seconds_per_step[span.peer_id], rtts[span.peer_id], span.length, 1)
        speeds[span.peer_id] = smooth(speeds.get(span.peer_id), sample)
    assert chosen == ["liar"] + ["honest"] * 5
    assert speeds["liar"] == pytest.approx(10.0)  # it is priced at 2 x 10 = 20 tokens/s per block, not 100,000


def test_an_honest_server_measured_as_fast_as_it_announces_keeps_its_place():
    blocks = swarm(4, {"fast": make_info(0, 4, throughput=100.0), "slow": make_info(0, 4, throughput=50.0)})
    speeds = {"fast": 90.0, "slow": 50.0}  # a bit under its claim (the client's view includes overheads)
    assert find_route(blocks, 0, 4, measured=speeds) == [Span("fast", 0, 4)]


def test_forward_passes_are_drawn_by_believed_throughput():
    blocks = swarm(4, {"honest": make_info(0, 4, throughput=100.0), "liar": make_info(0, 4, throughput=100_000.0)})
    rng = random.Random(0)
    draws = Counter(sample_route(blocks, 0, 4, rng, measured={"liar": 10.0})[0].peer_id for _ in range(2000))
    assert 0.75 < draws["honest"] / 2000 < 0.9  # weights 100 : 20


def test_the_sequence_manager_prices_a_peer_by_what_observe_measured():
    manager = SequenceManager(None, "m", 4, ClientConfig(default_rtt=0.0))  # type: ignore[arg-type]
    manager.block_servers = swarm(4, {"honest": make_info(0, 4, throughput=100.0),
                                      "liar": make_info(0, 4, throughput=100_000.0)})
    manager.rtts = {"honest": 0.002, "liar": 0.002}
    manager.last_update = float("inf")  # no DHT read
    assert asyncio.run(manager.make_route(0, 4)) == [Span("liar", 0, 4)]
    manager.observe("liar", 0.402, blocks=4, tokens=1)
    manager.observe("liar", 0.001, blocks=4, tokens=1)  # under the round trip: ignored
    assert manager.speeds == {"liar": pytest.approx(10.0)}
    assert asyncio.run(manager.make_route(0, 4)) == [Span("honest", 0, 4)]
