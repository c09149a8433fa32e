"""server.presence.silence: the coverage watch counts a server as gone only once it stayed silent over two ping
rounds `confirm` seconds apart, and a round where most of the pinged servers were silent counts for nobody."""

from __future__ import annotations

from corolla.server.presence.silence import Silence


def test_one_missed_ping_is_not_a_death_a_second_one_later_is():
    watch = Silence(confirm=4.0)
    peers = {"a", "b", "c", "d", "e"}
    assert watch.round(peers - {"a"}, {"a"}, now=0.0) == set()  # silent once: not counted
    assert watch.round(peers - {"a"}, {"a"}, now=2.0) == set()  # again, but too soon (a stagger's re-check)
    assert watch.round(peers - {"a"}, {"a"}, now=5.0) == {"a"}  # silent for 5 s over three rounds: gone
    assert watch.round(peers - {"a"}, {"a"}, now=10.0) == {"a"}  # and it stays gone while silent


def test_a_server_that_answers_again_starts_afresh():
    watch = Silence(confirm=4.0)
    others = {"b", "c", "d", "e"}
    watch.round(others, {"a"}, now=0.0)
    assert watch.round(others | {"a"}, set(), now=5.0) == set()  # a slow answer in round one, then it answered
    assert watch.round(others, {"a"}, now=10.0) == set()  # a new silence: not counted at once
    assert watch.round(others, {"a"}, now=14.0) == {"a"}


def test_a_round_where_most_pinged_servers_are_silent_counts_for_nobody():
    """48 servers on two cores: pings time out in bulk because the pinger (or the machine) is slow, not because the
    swarm died; such rounds neither start nor confirm a silence."""
    watch = Silence(confirm=4.0, mass_min=4)
    pinged = {f"p{i}" for i in range(8)}
    silent = {f"p{i}" for i in range(5)}  # 5 of 8
    assert watch.round(pinged - silent, silent, now=0.0) == set()
    assert watch.round(pinged - silent, silent, now=5.0) == set()
    assert watch.round(pinged - silent, silent, now=10.0) == set()
    assert watch.round(pinged - {"p0"}, {"p0"}, now=11.0) == set()  # its silence only begins now
    assert watch.round(pinged - {"p0"}, {"p0"}, now=15.0) == {"p0"}


def test_a_quarter_of_the_servers_dying_at_once_is_still_seen():
    watch = Silence(confirm=4.0, mass_min=4)
    pinged = {f"p{i}" for i in range(12)}
    dead = {"p0", "p1", "p2"}  # a burst: 3 of 12
    assert watch.round(pinged - dead, dead, now=0.0) == set()
    assert watch.round(pinged - dead, dead, now=5.0) == dead
    # a few silent servers among a few pinged (under MASS_SILENCE_MIN) are judged one by one
    small = Silence(confirm=4.0, mass_min=4)
    small.round({"x"}, {"y", "z"}, now=0.0)
    assert small.round({"x"}, {"y", "z"}, now=5.0) == {"y", "z"}


def test_a_suspicion_not_followed_up_is_forgotten():
    watch = Silence(confirm=4.0)
    watch.round({"b", "c", "d"}, {"a"}, now=0.0)
    watch.round({"b", "c", "d"}, set(), now=20.0)  # "a" no longer pinged (its block gained servers)
    assert "a" not in watch.since
    assert watch.round({"b", "c", "d"}, {"a"}, now=21.0) == set()  # silent again later: a new silence
