"""The ban and backoff arithmetic (client.swarm.bans): exact durations, as its docstring's table says."""

from __future__ import annotations

import pytest

from corolla.client.swarm.bans import Ban, ban_seconds, banned_peers, next_ban, retry_delay


def test_a_ban_doubles_with_each_failure_up_to_the_cap():
    assert [ban_seconds(k, 0.5, 60.0) for k in range(1, 10)] == [0.5, 1, 2, 4, 8, 16, 32, 60, 60]


def test_an_unreachable_peer_is_banned_at_least_the_unreachable_ban_and_at_least_is_honoured():
    assert ban_seconds(1, 0.5, 60.0, unreachable=True, unreachable_ban=30.0) == 30.0
    assert ban_seconds(1, 0.5, 60.0, unreachable=False, unreachable_ban=30.0) == 0.5
    assert ban_seconds(2, 0.5, 60.0, at_least=60.0) == 60.0
    assert ban_seconds(10_000, 0.5, 60.0) == 60.0  # no overflow however many failures


def test_a_ban_needs_a_failure():
    with pytest.raises(ValueError):
        ban_seconds(0, 0.5, 60.0)


def test_next_ban_counts_failures_from_the_previous_ban():
    first = next_ban(None, now=100.0, min_backoff=15.0, max_backoff=1e9)
    assert first == Ban(until=115.0, failures=1, unreachable=False)
    second = next_ban(first, now=120.0, min_backoff=15.0, max_backoff=1e9)
    assert second == Ban(until=150.0, failures=2, unreachable=False)


def test_banned_peers_are_those_whose_ban_still_holds():
    bans = {"a": Ban(10.0, 1, False), "b": Ban(5.0, 1, True), "c": Ban(20.0, 2, True)}
    assert banned_peers(bans, now=7.0) == {"a", "c"}
    assert banned_peers(bans, now=7.0, unreachable_only=True) == {"c"}
    assert banned_peers(bans, now=30.0) == set()


def test_retries_go_at_once_then_wait_longer_up_to_five_seconds():
    assert [retry_delay(k, 0.5) for k in range(1, 6)] == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert retry_delay(100, 0.5) == 5.0
