"""server.presence.joining: a server's join is tried again after a passing failure (initial peers out of reach for a
moment, p2pd slow to start), and only then."""

from __future__ import annotations

import asyncio

import pytest

from corolla.server.presence.joining import join_with_retries, passing


class Joins:
    def __init__(self, failures: list[Exception]):
        self.failures, self.calls = list(failures), 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return "node"


def run(join, **kw):
    return asyncio.run(join_with_retries(join, pause=0.0, **kw))


def test_passing_failures_are_tried_again_until_one_joins():
    join = Joins([RuntimeError("DHT bootstrap failed: none of the initial peers answered (...)"),
                  RuntimeError("Daemon failed to start: 2026/11/29 failed to connect to bootstrap peers")])
    assert run(join, attempts=3) == "node" and join.calls == 3


def test_the_last_failure_is_raised_once_the_attempts_are_spent():
    join = Joins([RuntimeError("Daemon failed to start in 15.0 seconds")] * 5)
    with pytest.raises(RuntimeError, match="failed to start in 15.0"):
        run(join, attempts=3)
    assert join.calls == 3


def test_other_failures_end_the_start_at_once():
    join = Joins([ValueError("--initial-peers 'x': not a multiaddr"), RuntimeError("listen tcp: address already in use")])
    with pytest.raises(ValueError):
        run(join, attempts=3)
    assert join.calls == 1
    assert not passing(RuntimeError("listen tcp 127.0.0.1:1: bind: address already in use"))


def test_a_server_told_to_stop_does_not_try_again():
    join = Joins([RuntimeError("DHT bootstrap failed")] * 3)
    with pytest.raises(RuntimeError):
        run(join, attempts=3, stopped=lambda: True)
    assert join.calls == 1
