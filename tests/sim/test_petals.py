"""Petals' rules as the simulator runs them (corolla.sim.petals), on small swarms worked out by hand."""

from __future__ import annotations

import random

import numpy as np
import pytest

from corolla.client.swarm.routing import Span
from corolla.server.presence.block_selection import choose_best_blocks
from corolla.sim.petals import (HOP_FIXED, MAX_HOP_RTT, NO_CACHE_PENALTY, UNKNOWN_RTT, PetalsIndex, PetalsPolicy,
                                _Holder, choose_window, rebalanced_minimum, route, should_move)
from corolla.sim.step_cost import MEASURED


def test_the_window_with_the_smallest_sorted_throughputs_wins_where_corolla_compares_sums():
    throughputs = [0, 1, 9, 0, 2, 2]  # windows of 3 sorted: [0,1,9] [0,1,9] [0,2,9] [0,2,2]
    assert choose_window(3, throughputs) == (0, 3)  # second-weakest block 1 < 2
    assert choose_best_blocks(3, throughputs) == (3, 6)  # corolla: same minimum, smaller sum
    assert choose_window(2, [5, 5, 5, 5]) == (0, 2)  # ties: the earliest
    with pytest.raises(ValueError):
        choose_window(5, [1, 2])


def test_a_server_never_leaves_a_block_it_alone_covers_while_every_block_is_covered():
    assert should_move((0, 2), 10.0, [10, 10, 5, 5], random.Random(0), lambda target: 100.0) is None


def test_a_server_already_in_its_best_window_stays():
    assert should_move((0, 2), 2.0, [5, 5, 20, 20], random.Random(0), lambda target: 100.0) is None


def test_a_server_moves_when_the_simulated_rebalance_beats_the_balance_quality():
    # without us [20, 20, 5, 5]: best window 2:4; minimum now 5
    assert should_move((0, 2), 10.0, [30, 30, 5, 5], random.Random(0), lambda target: 15.0) == (2, 4)  # 5/15 < 0.749
    assert should_move((0, 2), 10.0, [30, 30, 5, 5], random.Random(0), lambda target: 6.0) is None  # 5/6 > 0.749


def test_the_simulated_rebalance_lets_every_server_rechoose_until_none_moves():
    # two servers of 10 on 0:2, one of 1 on 2:4: one of the tens moves to 2:4, in whatever order they go
    for seed in range(5):
        assert rebalanced_minimum([(0, 2, 10.0), (0, 2, 10.0), (2, 4, 1.0)], 4, random.Random(seed)) == \
            pytest.approx(10.0, abs=0.05)


def holders(servers: dict[str, tuple[int, int, float, int]], num_blocks: int) -> list[list[_Holder]]:
    return [[_Holder(p, end, per_block, free) for p, (start, end, per_block, free) in servers.items()
             if start <= b < end] for b in range(num_blocks)]


def test_petals_routes_by_latency_and_compute_with_a_penalty_for_a_full_cache():
    servers = {"a": (0, 4, 0.1, 10**6), "b": (0, 2, 0.001, 10**6), "c": (2, 4, 0.001, 10**6)}
    rtts = {"a": 0.02, "b": 0.02, "c": 0.02}
    # a: 0.01 + 0.018 + 4 x 0.1 = 0.428 s; b then c: 2 x (0.01 + 0.018 + 0.002) = 0.06 s
    assert route(holders(servers, 4), 0, 4, 100, rtts, ()) == [Span("b", 0, 2), Span("c", 2, 4)]
    full = {**servers, "c": (2, 4, 0.001, 10)}  # +10 s: its free cache cannot hold the session
    # b, then a entered at block 2: 0.03 + 0.028 + 2 x 0.1 = 0.258 s < a alone, 0.428 s
    assert route(holders(full, 4), 0, 4, 100, rtts, ()) == [Span("b", 0, 2), Span("a", 2, 4)]
    assert route(holders(servers, 4), 0, 4, 100, rtts, {"b", "c"}) == [Span("a", 0, 4)]
    assert route(holders({"b": servers["b"]}, 4), 0, 4, 100, rtts, ()) is None


def test_a_petals_route_leaves_a_server_only_at_the_end_of_its_span():
    servers = {"d": (0, 3, 0.001, 10**6), "f": (2, 4, 0.001, 10**6)}
    # d then f from block 2 would be cheaper, but d's span goes on to 3: f is entered at 3
    assert route(holders(servers, 4), 0, 4, 1, {}, ()) == [Span("d", 0, 3), Span("f", 3, 4)]


def test_petals_bans_retries_and_announced_throughput():
    policy = PetalsPolicy()
    ban = None
    durations = []
    for now in (0.0, 100.0, 200.0):
        ban = policy.ban(ban, now, unreachable=False)
        durations.append(ban.until - now)
    assert durations == [15.0, 30.0, 60.0]
    assert [policy.retry_delay(n) for n in (1, 2, 3, 7, 8, 20)] == [1.0, 2.0, 4.0, 60.0, 60.0, 60.0]
    assert not policy.gives_up(10**6)
    forward = 1024 / MEASURED.prefill_seconds(1024)
    assert policy.announced_throughput(MEASURED, 1.0, 9) == pytest.approx(forward / 5)


def test_the_vectorized_routes_are_the_plain_rules_routes():
    rng = random.Random(0)
    for _ in range(200):
        num_blocks = rng.randint(2, 12)
        servers = {}
        for i in range(rng.randint(1, 12)):
            start = rng.randint(0, num_blocks - 1)
            servers[f"p{i:02d}"] = (start, rng.randint(start + 1, num_blocks), rng.uniform(0.001, 0.1),
                                    rng.choice([10, 10**6]))
        rtts = {p: rng.uniform(0.0, 0.3) for p in servers if rng.random() < 0.8}
        view = holders(servers, num_blocks)
        banned = {p for p in servers if rng.random() < 0.2}
        start = rng.randint(0, num_blocks - 1)
        end = rng.randint(start + 1, num_blocks)
        index = PetalsIndex(view, 100, rtts)
        plain = route(view, start, end, 100, rtts, banned)
        fast = index.route(start, end, np.ones(len(index.peers)), banned)
        # equal costs may break ties differently: compare what each route costs
        assert (plain is None) == (fast is None)
        if plain is not None:
            assert cost(plain, servers, rtts) == pytest.approx(cost(fast, servers, rtts))


def cost(spans, servers, rtts) -> float:
    total = 0.0
    for span in spans:
        _, _, per_block, free = servers[span.peer_id]
        total += min(rtts.get(span.peer_id, UNKNOWN_RTT), MAX_HOP_RTT) / 2 + HOP_FIXED + span.length * per_block
        total += NO_CACHE_PENALTY if free < 100 else 0.0
    return total
