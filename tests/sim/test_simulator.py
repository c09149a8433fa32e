"""Whole simulated swarms, small enough to run in seconds: determinism, failover, healing, the CLI."""

from __future__ import annotations

import json

import pytest

from corolla.cli.main import main
from corolla.sim import Scenario, simulate
from corolla.sim import servers as srv
from corolla.sim.scenario import Region, SpeedClass
from corolla.sim.simulator import World

ONE_REGION = dict(regions=(Region("lan", 1.0, 1.0),), rtt_ms=((10.0,),))
SLOW = SpeedClass("slow", 1.0, 0.5, 8, 65_536)
SMALL = dict(servers=12, blocks=20, duration=400.0, warmup=120.0, join_period=30.0, churn=0.0, burst_fraction=0.0,
             new_tokens_min=96, new_tokens_max=160, demand=0.4, classes=(SLOW,))
FIELDS = ("served_tokens_per_s", "capacity_bound_tokens_per_s", "tpot_ms_p50", "tpot_ms_p99", "admission_wait_s_p99",
          "failed_sessions", "uncovered_block_seconds", "moves_per_server_hour", "dht_bytes_per_server_per_min",
          "wall_s")


def without_wall(result: dict) -> dict:
    return {k: v for k, v in result.items() if k not in ("wall_s", "cpu_s")}


def test_a_run_is_a_function_of_its_scenario_and_seed():
    a, b = simulate(Scenario(**SMALL, seed=3)), simulate(Scenario(**SMALL, seed=3))
    assert without_wall(a) == without_wall(b)
    assert without_wall(simulate(Scenario(**SMALL, seed=4))) != without_wall(a)
    assert all(field in a for field in FIELDS)
    assert a["failed_sessions"] == 0 and a["finished_sessions"] > 100
    assert 0.3 < a["served_fraction_of_bound"] < 0.5  # 0.4 of the bound asked for, served


def test_sessions_fail_over_when_servers_crash_and_none_is_lost():
    result = simulate(Scenario(**{**SMALL, "burst_fraction": 0.25, "burst_at": 200.0, "burst_return": 0.0}))
    assert result["leg_failures"] > 0 and result["failed_sessions"] == 0
    assert result["finished_sessions"] > 50


def sparse_world(policy: str) -> World:
    """4 servers of 2 blocks on a 6-block model: after joining, one region has two servers, the others one each."""
    kind = SpeedClass("cpu", 1.0, 1.0, 2, 65_536)
    return World(Scenario(servers=4, blocks=6, duration=900.0, warmup=100.0, join_period=20.0, churn=0.0,
                          burst_fraction=0.0, demand=0.2, new_tokens_min=16, new_tokens_max=32, classes=(kind,),
                          policy=policy, seed=1, **ONE_REGION))


def heal_time(world: World) -> float | None:
    """Kill a server that alone holds its blocks at t=200 s; seconds until every block is served again."""
    world.start()
    world.q.run_until(200.0)
    online = [s for s in world.servers if s.state == "online"]
    assert len(online) == 4 and (world.online >= 1).all()
    lonely = next(s for s in online if (world.online[s.start : s.end] == 1).all())
    srv.leave(world, lonely, crash=False)
    assert (world.online == 0).any()
    for t in range(201, 900):
        world.q.run_until(float(t))
        if (world.online >= 1).all():
            return t - 200.0
    return None


def test_a_block_left_without_server_is_covered_again_within_seconds():
    healed = heal_time(sparse_world("corolla"))
    assert healed is not None and healed <= 20.0  # the watch (5 s), a short stagger, loading 2 blocks (4 s)


def test_petals_rules_heal_only_at_their_next_balance_check():
    healed = heal_time(sparse_world("petals"))
    assert healed is None or healed > 20.0


def test_the_cli_prints_the_json_fields_and_a_table(capsys):
    args = ["simulate", "--servers", "10", "--blocks", "20", "--duration", "200", "--warmup", "60", "--join-period",
            "20", "--churn", "0", "--burst-fraction", "0", "--new-tokens-min", "16", "--new-tokens-max", "40",
            "--demand", "0.1"]
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert all(field in result for field in FIELDS)
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "served / bound" in table and "moves per server-hour" in table


@pytest.mark.parametrize("args, says", [
    (["--servers", "-5"], "servers must be >= 1"),
    (["--blocks", "4"], "16 blocks per server, but the model has 4"),
    (["--duration", "0"], "duration must be within"),
])
def test_the_cli_refuses_a_bad_scenario_in_one_line(args, says, capsys):
    assert main(["simulate", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1


def test_the_cli_reads_a_scenario_file(tmp_path, capsys):
    path = tmp_path / "lan.json"
    path.write_text(json.dumps({"servers": 6, "blocks": 6, "clients": 4, "churn": 0, "burst_fraction": 0,
                                "duration": 200, "warmup": 60, "join_period": 10, "new_tokens_min": 16, "new_tokens_max": 40,
                                "classes": [{"name": "cpu", "share": 1.0, "speed": 1.0, "blocks": 2,
                                             "cache_tokens": 16384}],
                                "regions": [{"name": "lan", "servers": 1.0, "clients": 1.0}], "rtt_ms": [[20]],
                                "placements": [[0, 2], [2, 4], [4, 6], [0, 2], [2, 4], [4, 6]]}))
    assert main(["simulate", "--scenario", str(path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["finished_sessions"] > 0 and result["moves"] == 0  # fixed placements never move
    (tmp_path / "bad.json").write_text('{"servers": 6, "bogus": 1}')
    assert main(["simulate", "--scenario", str(tmp_path / "bad.json")]) == 2
    assert "unknown key(s) bogus" in capsys.readouterr().err


def test_a_corolla_session_refused_on_one_span_closes_every_span_it_opened_and_routes_them_all_again():
    """As client.chain.route_opening.open_route does: the spans open at once; one server has no room, so after the
    allocation wait the client closes the span that did open (its server frees the room), bans the full server
    (the first failed span) and routes the whole model again."""
    kind = SpeedClass("cpu", 1.0, 1.0, 2, 65_536)
    world = World(Scenario(servers=2, blocks=4, duration=600.0, warmup=100.0, join_period=1.0, churn=0.0,
                           burst_fraction=0.0, clients=1, classes=(kind,), placements=((0, 2), (2, 4)), seed=1,
                           **ONE_REGION))
    world.start()
    world.q.run_until(30.0)  # both servers online; the one client starts at warmup / 2
    first, second = world.servers
    assert first.state == second.state == "online" and not world.sessions
    second.cache_free = 0  # full: the session's second span waits for room it will not get
    world.q.run_until(50.5)
    (session,) = world.sessions.values()
    opened, refused = session.legs
    assert opened.granted and not refused.granted and first.cache_free < kind.cache_tokens
    world.q.run_until(50.5 + world.alloc_timeout)
    assert opened.failed and refused.failed and not opened.granted  # closed, both
    assert set(session.bans) == {second.peer}  # only the first failed span's server is blamed
    assert session.legs[0] is not opened and session.legs[0].span.start == 0  # the whole model routed again


def test_every_server_that_refused_a_corolla_opening_is_banned_and_counts_as_one_failure():
    """As client.chain.route_opening.count_refusals does: two of three spans find no room, so after the allocation
    wait both full servers are banned and the next opening starts with two failures counted, not one."""
    kind = SpeedClass("cpu", 1.0, 1.0, 2, 65_536)
    world = World(Scenario(servers=3, blocks=6, duration=600.0, warmup=100.0, join_period=1.0, churn=0.0,
                           burst_fraction=0.0, clients=1, classes=(kind,), placements=((0, 2), (2, 4), (4, 6)),
                           seed=1, **ONE_REGION))
    world.start()
    world.q.run_until(30.0)
    first, second, third = world.servers
    second.cache_free = third.cache_free = 0
    world.q.run_until(50.5)
    (session,) = world.sessions.values()
    world.q.run_until(50.5 + world.alloc_timeout)
    assert set(session.bans) == {second.peer, third.peer}
    again = session.legs[0].opening
    assert again is not None and again.failures == 2 and session.legs[0].span.start == 0


def test_a_replacement_span_failing_during_its_replay_counts_as_open_routes_own_failure():
    """A failover opens the replacement with open_route, which replays the tokens so far before it returns and
    counts failures of its own: a second crash during that replay does not use up the step's retries (a burst
    taking several servers of one route at once used to fail sessions at half load)."""
    kind = SpeedClass("cpu", 1.0, 1.0, 2, 65_536)
    world = World(Scenario(servers=4, blocks=4, duration=600.0, warmup=100.0, join_period=1.0, churn=0.0,
                           burst_fraction=0.0, clients=1, classes=(kind,), seed=1, new_tokens_min=400,
                           new_tokens_max=400, placements=((0, 2), (2, 4), (2, 4), (2, 4)), **ONE_REGION))
    world.start()
    t = 50.0
    while not (world.sessions and next(iter(world.sessions.values())).slot is not None):
        t += 0.5
        world.q.run_until(t)
    (session,) = world.sessions.values()
    second = world.servers[session.legs[1].server]
    srv.leave(world, second, crash=True)
    while not any(leg.granted and not leg.filled for leg in session.legs):  # the replacement opened, replaying
        t += 0.01
        world.q.run_until(t)
    assert session.failures == 1
    replaying = next(leg for leg in session.legs if not leg.filled)
    srv.leave(world, world.servers[replaying.server], crash=True)
    while not replaying.failed:
        t += 0.01
        world.q.run_until(t)
    assert session.failures == 1  # the replay's failure is the opening's (open_route's count), not the step's
    assert replaying.origin is not None and replaying.origin.failures == 0  # counted into the next opening
    world.q.run_until(t + 5.0)
    assert session.slot is not None and session.failures == 0  # decoding again, on the fourth server


def test_a_server_past_its_compute_peak_keeps_a_new_session_waiting_until_it_is_back_under():
    """Admission by compute (server.compute.saturation, server.cache.queue.grants(saturated=...)): with cache room
    to spare, a server whose fluid queue says it is past its peak grants nothing; the session's request waits in its
    queue and is granted at the first tick after the queue is gone."""
    kind = SpeedClass("cpu", 1.0, 1.0, 4, 65_536)
    world = World(Scenario(servers=1, blocks=4, duration=600.0, warmup=100.0, join_period=1.0, churn=0.0,
                           burst_fraction=0.0, clients=1, classes=(kind,), placements=((0, 4),), seed=1, **ONE_REGION))
    queue_in_front = {"overload": 3.0}
    solve = world.fluid.solve

    def solve_with_a_queue(dt: float, iterations: int = 2) -> None:  # as if other sessions kept it past its peak
        solve(dt, iterations)
        world.fluid.overload[0] = queue_in_front["overload"]

    world.fluid.solve = solve_with_a_queue  # type: ignore[method-assign]
    world.start()
    world.q.run_until(30.0)
    (server,) = world.servers
    assert server.state == "online" and not world.sessions and world.policy.admits_by_compute
    t = 30.0
    while not server.queue and t < 60.0:  # the client starts at warmup / 2 and asks for cache
        t += 0.05
        world.q.run_until(t)
    (session,) = world.sessions.values()
    (leg,) = session.legs
    world.q.run_until(t + 2.0)
    assert not leg.granted and server.cache_free == kind.cache_tokens and server.queue  # held, with room to spare
    queue_in_front["overload"] = 1.0  # back under its peak: the next tick lets the session in
    world.q.run_until(t + 2.0 + 2 * world.scenario.tick)
    assert leg.granted and not server.queue and server.cache_free < kind.cache_tokens


def test_a_corolla_replay_runs_at_decode_priority_and_a_long_prompt_in_the_prefill_backlog():
    """client.chain.route_opening.replay sends a failover's history in chunks servers merge (decode priority): its
    compute joins the server's merged prefills, not the backlog long prefills wait in; a long step sent whole does."""
    world = World(Scenario(**SMALL))
    world.start()  # the servers exist (none has joined yet: nothing else is in their backlogs)
    tokens = world.merge_max_tokens * 4
    world.prefill_visit(0, 8, tokens, chunked=True)
    assert world.fluid.prefill_now[0] > 0 and world.fluid.prefill_work[0] == 0
    world.prefill_visit(0, 8, tokens)
    assert world.fluid.prefill_work[0] > 0
    petals = World(Scenario(**SMALL, policy="petals"))
    assert world.policy.replays_in_short_chunks and not petals.policy.replays_in_short_chunks
