"""Block selection and rebalancing: exact choices on plain per-block throughputs, and swarms that settle."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest

from corolla.protocol.messages import ServerInfo, ServerState
from corolla.server.compute.block_stack import BlockStack
from corolla.server.presence import rebalancing
from corolla.server.presence.block_selection import choose_best_blocks, parse_block_range, should_move
from corolla.server.presence.load import LoadMeter
from corolla.server.rebalancer import Rebalancer


def test_parse_block_range_checks_bounds():
    assert parse_block_range("2:5", 8) == (2, 5)
    for bad in ("5:2", "0:9", "a:b", "3"):
        with pytest.raises(ValueError):
            parse_block_range(bad, 8)


def test_new_server_takes_the_least_served_blocks():
    assert choose_best_blocks(2, [10, 10, 0, 0, 10, 10]) == (2, 4)
    assert choose_best_blocks(3, [5, 5, 5, 5]) == (0, 3)
    assert choose_best_blocks(2, [0, 7, 0, 0]) == (2, 4)
    with pytest.raises(ValueError):
        choose_best_blocks(5, [0, 0])


def test_server_doubling_up_on_covered_blocks_moves_to_the_uncovered_ones():
    # we (10) and another server (10) both hold 0:2; nobody holds 2:4
    assert should_move((0, 2), 10, [20, 20, 0, 0], 0.2) == (2, 4)


def test_server_moves_to_a_weakly_served_region_when_the_minimum_rises_enough():
    # without us: [20, 20, 5, 5]; moving makes the minimum 15 instead of 5
    assert should_move((0, 2), 10, [30, 30, 5, 5], 0.2) == (2, 4)
    # overlapping move: without us [10, 20, 5]; 1:3 lifts the minimum from 5 to 10
    assert should_move((0, 2), 10, [20, 30, 5], 0.2) == (1, 3)


def test_server_lifts_one_of_two_equally_weak_regions_even_though_the_minimum_stays():
    # without us [15, 15, 5, 5, 5, 5]: moving to 2:4 leaves 4:6 at 5, but only two weak blocks instead of four
    assert should_move((0, 2), 10, [25, 25, 5, 5, 5, 5], 0.2) == (2, 4)
    assert should_move((0, 2), 10, [20, 20, 0, 0, 0, 0], 0.2) == (2, 4)


def test_only_holder_of_its_blocks_never_leaves_them_uncovered():
    assert should_move((2, 4), 10, [0, 0, 10, 10], 0.2) is None  # 0:2 is empty too, but leaving empties 2:4
    assert should_move((0, 2), 10, [10, 10, 3, 3], 0.2) is None
    assert should_move((1, 3), 10, [5, 10, 10], 0.0) is None


def test_ties_and_small_gains_do_not_move():
    assert should_move((0, 2), 10, [20, 20, 10, 10], 0.2) is None  # without us [10, 10, 10, 10]: no better window
    # without us [10, 11, 10]: block 0 is as weak as ours, moving keeps the minimum at 10
    assert should_move((2, 3), 2, [10, 11, 12], 0.2) is None
    # without us [10, 11, 10.5]: moving lifts the minimum from 10 to 10.5, a 5% gain, under the 20% margin
    assert should_move((2, 3), 5, [10, 11, 15.5], 0.2) is None
    assert should_move((2, 3), 5, [10, 11, 15.5], 0.01) == (0, 1)


def test_should_move_rejects_bad_arguments():
    with pytest.raises(ValueError):
        should_move((2, 5), 1, [0, 0, 0, 0], 0.2)
    with pytest.raises(ValueError):
        should_move((0, 1), 1, [1, 0], -0.1)


def settle(num_blocks: int, servers: list[tuple[tuple[int, int], float]], min_improvement: float, max_rounds: int = 10):
    """Servers take turns running should_move on the shared state until a full round moves no one.

    Returns (placements seen, rounds taken). Asserts that every move raises (minimum, -number of weak blocks)
    and that no placement ever repeats.
    """
    spans = [span for span, _ in servers]
    throughputs = [t for _, t in servers]

    def per_block() -> list[float]:
        return [sum(t for (s, e), t in zip(spans, throughputs) if s <= b < e) for b in range(num_blocks)]

    seen = [tuple(spans)]
    for round_ in range(1, max_rounds + 1):
        moved = False
        for i in range(len(spans)):
            before = per_block()
            target = should_move(spans[i], throughputs[i], before, min_improvement)
            if target is not None:
                spans[i], moved = target, True
                after, threshold = per_block(), min(before) * (1 + min_improvement)
                weak_before, weak_after = (sum(t <= threshold for t in v) for v in (before, after))
                assert min(after) > min(before) or (min(after) == min(before) and weak_after < weak_before)
                assert tuple(spans) not in seen, f"placement {spans} came back"
                seen.append(tuple(spans))
        if not moved:
            return seen, round_
    raise AssertionError(f"no convergence in {max_rounds} rounds: {seen}")


def test_three_servers_on_the_same_blocks_spread_out_and_stop():
    seen, rounds = settle(6, [((0, 2), 10), ((0, 2), 10), ((0, 2), 10)], 0.2)
    assert seen[-1] == ((2, 4), (4, 6), (0, 2))
    assert rounds == 2  # one round of moves, one quiet round


def test_two_servers_taking_turns_do_not_chase_each_other():
    # A leaves B's blocks for the empty ones; B, without itself, finds its own blocks the weakest and stays
    seen, rounds = settle(4, [((0, 2), 10), ((0, 2), 12)], 0.2)
    assert seen == [((0, 2), (0, 2)), ((2, 4), (0, 2))] and rounds == 2
    # overlapping spans and uneven speeds: the slow server's move does not pull the fast one after it
    seen, rounds = settle(3, [((0, 2), 10), ((0, 2), 30), ((1, 3), 5)], 0.2)
    assert seen == [((0, 2), (0, 2), (1, 3)), ((1, 3), (0, 2), (1, 3))] and rounds == 2


def test_slow_server_moves_to_the_weakest_block_once_a_fast_one_has_left():
    seen, _ = settle(5, [((0, 2), 10), ((0, 2), 10), ((0, 1), 3), ((3, 5), 4)], 0.2)
    assert seen[-1] == ((2, 4), (0, 2), (4, 5), (3, 5))  # per block [10, 10, 10, 14, 7]: the minimum rose from 0


def test_random_swarms_converge_without_revisiting_a_placement():
    rng = random.Random(0)
    for _ in range(300):
        num_blocks = rng.randint(2, 8)
        servers = []
        for _ in range(rng.randint(2, 5)):
            length = rng.randint(1, num_blocks)
            start = rng.randint(0, num_blocks - length)
            servers.append(((start, start + length), float(rng.choice([1, 5, 10, 12, 50]))))
        settle(num_blocks, servers, rng.choice([0.0, 0.05, 0.2]), max_rounds=5)  # 3000 seeds: at most 4 rounds


# ---------------------------------------------------------------- server.presence.rebalancing
def info(start: int, end: int, throughput: float, state: ServerState = ServerState.ONLINE) -> ServerInfo:
    return ServerInfo(state=state, start_block=start, end_block=end, throughput=throughput, cache_tokens_total=1,
                      cache_tokens_free=1, torch_dtype="float32", version="0", protocol_version=1,
                      max_session_length=1)


def test_a_block_gets_its_servers_throughput_shared_over_their_blocks():
    assert rebalancing.block_share(100.0, 0, 4) == 25.0
    view = [{"a": info(0, 4, 100.0), "b": info(0, 1, 10.0)}, {"a": info(0, 4, 100.0)},
            {"a": info(0, 4, 100.0), "off": info(2, 3, 50.0, ServerState.OFFLINE)},
            {"a": info(0, 4, 100.0), "j": info(3, 4, 8.0, ServerState.JOINING)}]
    assert rebalancing.swarm_capacity(view) == [35.0, 25.0, 25.0, 33.0]  # OFFLINE counts for nothing
    assert rebalancing.swarm_capacity(view, me="a") == [10.0, 0.0, 0.0, 8.0]
    assert rebalancing.holder_counts(view) == [2, 1, 1, 2]


def test_the_watch_runs_while_a_block_has_fewer_than_five_servers_and_pings_theirs():
    assert rebalancing.needs_watch([5, 6, 4]) and not rebalancing.needs_watch([5, 5, 9])
    assert rebalancing.uncovered([1.0, 0.0]) and not rebalancing.uncovered([1.0, 0.5])
    many = {f"p{i}": info(0, 2, 10.0) for i in range(6)}
    view = [many, many, {"x": info(2, 4, 10.0), "me": info(2, 3, 10.0)},
            {"x": info(2, 4, 10.0), "off": info(3, 4, 10.0, ServerState.OFFLINE)}]
    assert rebalancing.to_check(view, me="me") == ["x"]  # blocks 2 and 3 are thin; OFFLINE records do not count
    # a crashed server's record outlives it: the watch's pings drop it from the view
    assert rebalancing.swarm_capacity(view, me="me", gone={"x"})[2:] == [0.0, 0.0]


def test_a_watcher_pings_the_thinnest_blocks_servers_first_and_at_most_a_few_the_same_every_round():
    # 4 holders on each of 12 blocks (48 servers, evenly thin) and one block held by "lone" alone
    view = [{f"p{4 * b + i}": info(b, b + 1, 10.0) for i in range(4)} for b in range(12)]
    view.append({"lone": info(12, 13, 1.0)})
    pinged = {me: rebalancing.to_check(view, me) for me in (f"p{i}" for i in range(48))}
    assert all(len(peers) == rebalancing.WATCH_PINGS and peers[0] == "lone" for peers in pinged.values())
    assert all(me not in peers for me, peers in pinged.items())
    assert pinged["p0"] == rebalancing.to_check(view, "p0")  # the same servers every round
    # the watchers share the evenly thin ones out: every server is pinged by someone, none by all
    times = {peer: sum(peer in peers for peers in pinged.values()) for peer in (f"p{i}" for i in range(48))}
    assert min(times.values()) >= 1 and max(times.values()) < 24
    assert rebalancing.watch_order("me", {"a": 2, "b": 1, "c": 3}, limit=2) == ["b", "a"]


def test_of_two_servers_that_chose_the_same_blocks_only_the_larger_peer_id_settles_elsewhere():
    others = [10.0, 10.0, 10.0, 0.0, 0.0, 0.0]  # the other server of 30 tokens/s on 0:3, share 10 per block
    assert rebalancing.settle_move("B", (0, 3), 10.0, others, joining_here={"A": (0, 3, 10.0)}, quality=0.2) == (3, 6)
    assert rebalancing.settle_move("A", (0, 3), 10.0, others, joining_here={"B": (0, 3, 10.0)}, quality=0.2) is None
    assert rebalancing.settle_move("A", (0, 3), 10.0, others, joining_here={}, quality=0.2) == (3, 6)


def test_a_herd_that_took_the_same_blocks_spreads_in_one_settle_round():
    # 12 blocks; 0:8 held by one server each (share 10); five servers chose 8:12 on the same stale view
    online = [10.0] * 8 + [0.0] * 4
    herd = {peer: (8, 12, 10.0) for peer in "ABCDE"}
    choices = {}
    for me in herd:
        others = {peer: span for peer, span in herd.items() if peer != me}
        capacity = [c + 10.0 * sum(1 for p in others if 8 <= i < 12) for i, c in enumerate(online)]  # without me
        target = rebalancing.settle_move(me, (8, 12), 10.0, capacity, others, quality=0.2)
        choices[me] = target or (8, 12)
    # A (smallest id) keeps 8:12, B too (as weak as any other window then), C and D go to the weakest windows in
    # turn, and E, with every block at two servers, keeps its own: 2-3 servers per block (28 server-blocks on 12)
    assert choices["A"] == choices["B"] == choices["E"] == (8, 12)
    assert (choices["C"], choices["D"]) == ((0, 4), (4, 8))
    count = [1] * 8 + [0] * 4  # the ONLINE servers
    for start, end in choices.values():
        for i in range(start, end):
            count[i] += 1
    assert count == [2] * 8 + [3] * 4


def test_a_joining_record_with_a_range_the_model_cannot_hold_is_left_out_of_the_settle():
    # a hostile or broken JOINING record on our blocks claiming 0:1000 of a 6-block model: no crash, it is ignored
    capacity = [10.0, 10.0, 10.0, 10.0, 0.0, 0.0]
    assert rebalancing.settle_move("M", (4, 6), 10.0, capacity, {"A": (0, 1000, 10.0)}, quality=0.2) is None
    assert rebalancing.settle_move("M", (4, 6), 10.0, capacity, {"A": (5, 3, 10.0)}, quality=0.2) is None


def test_a_settling_server_ignores_joiners_with_larger_peer_ids_and_partial_overlaps_count_at_their_blocks():
    capacity = [10.0, 10.0, 10.0, 10.0, 0.0, 0.0]  # without me: "Z" (larger id) joining 2:4 adds 10 there
    # "Z" gives way to us, not we to it: we judge our 4:6 against the swarm without it, and keep it
    assert rebalancing.settle_move("M", (4, 6), 10.0, capacity, {"Z": (2, 4, 10.0)}, quality=0.2) is None
    # a smaller id on the same blocks placed first: 4:6 then has 10, 2:4 has 0 once Z is left out: we move there
    assert rebalancing.settle_move("M", (4, 6), 10.0, [10.0, 10.0, 10.0, 10.0, 10.0, 10.0],
                                   {"A": (4, 6, 10.0), "Z": (2, 4, 10.0)}, quality=0.2) == (2, 4)


def test_a_move_onto_a_block_without_server_is_urgent_and_ignores_the_cooldown():
    # without us [10, 10, 0, 0]: we (share 10) double 0:2
    move = rebalancing.plan_move((0, 2), 10.0, [10, 10, 0, 0], 0.2, since_last_move=1.0, cooldown=600.0)
    assert move == rebalancing.Move((2, 4), urgent=True)
    assert rebalancing.drain_seconds(move, 60.0) == 0.0


def test_an_ordinary_move_waits_for_the_cooldown_and_drains():
    # without us [20, 20, 5, 5]: moving lifts the minimum from 5 to 15
    assert rebalancing.plan_move((0, 2), 10.0, [20, 20, 5, 5], 0.2, since_last_move=30.0, cooldown=600.0) is None
    move = rebalancing.plan_move((0, 2), 10.0, [20, 20, 5, 5], 0.2, since_last_move=700.0, cooldown=600.0)
    assert move == rebalancing.Move((2, 4), urgent=False) and rebalancing.drain_seconds(move, 60.0) == 60.0


def test_a_new_server_waits_the_cooldown_too():
    # measured at 48 servers: servers allowed to move at their first check moved in herds on lagging views (24
    # moves in 9 minutes, 4 onto the same blocks within 10 s) while the joint settle had already placed them evenly
    fresh = Rebalancer(SimpleNamespace(config=SimpleNamespace()), announcer=None, worker=None)  # type: ignore[arg-type]
    assert 0.0 <= time.monotonic() - fresh.last_move < 5.0


def test_a_move_that_leaves_a_block_bare_drains_first_even_onto_uncovered_blocks():
    # we alone hold 0:1 of 0:2; blocks 2:6 have no server: covering 2:4 uncovers block 0, so it drains
    move = rebalancing.plan_move((0, 2), 10.0, [0, 10, 0, 0, 0, 0], 0.2, since_last_move=700.0, cooldown=600.0)
    assert move is not None and move.target == (2, 4) and not move.urgent


def test_check_and_join_delays_are_jittered_within_their_bounds():
    rng = random.Random(0)
    checks = [rebalancing.check_delay(rng, 120.0) for _ in range(1000)]
    assert 90.0 <= min(checks) and max(checks) <= 150.0
    joins = [rebalancing.join_delay(rng, 2.0) for _ in range(1000)]
    assert 0.0 <= min(joins) and max(joins) <= 2.0 and len(set(joins)) == 1000


def test_the_load_meter_reports_the_median_recent_decode_step_per_block():
    now = [100.0]
    meter = LoadMeter(lambda: 4, clock=lambda: now[0])
    assert meter.step_seconds() == 0.0
    decode = BlockStack.decode_batch  # the decode step path (server.metrics.step_path)
    meter.observe(decode, 3, [0.04, 0.08, 0.4])
    meter.observe(len, 1, [10.0])  # not a step: ignored
    assert meter.step_seconds() == pytest.approx(0.02)  # median 0.08 s over 4 blocks
    now[0] += 61.0
    assert meter.step_seconds() == 0.0  # older than the window


def test_a_joining_server_draws_among_equally_weak_windows_that_tile_the_weak_region():
    import random

    from corolla.server.presence.block_selection import choose_joining_blocks

    rng = random.Random(0)
    even = [25.0] * 48  # every block as strong: any of the 12 tiles 0:4, 4:8, ...
    drawn = {choose_joining_blocks(4, even, rng) for _ in range(200)}
    assert drawn == {(s, s + 4) for s in range(0, 48, 4)}
    # a region with no server (blocks 24:48): tiles of it only, never a window over a served block
    region = [25.0] * 24 + [0.0] * 24
    drawn = {choose_joining_blocks(4, region, rng) for _ in range(200)}
    assert drawn == {(s, s + 4) for s in range(24, 48, 4)}
    # a weakest window strictly better than all others is taken, as choose_best_blocks takes it
    assert {choose_joining_blocks(2, [10, 10, 0, 0, 10, 10], rng) for _ in range(50)} == {(2, 4)}
    assert {choose_joining_blocks(2, [5, 0, 0, 5, 0, 0], rng) for _ in range(50)} == {(1, 3)}
