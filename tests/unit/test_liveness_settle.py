"""monitor.liveness.ping_servers gives up a ping that is still out once the others have answered (a vanished host on a
real network never refuses, it just never answers), and only then: fewer than half answered, or settle=False, waits
for the timeout. The servers are fakes of request_info: this is the rule, the real pings are tests/monitor's."""

from __future__ import annotations

import asyncio
import time

import pytest

from corolla.monitor import liveness
from corolla.protocol.errors import PeerUnavailable


class FakeP2P:
    async def list_peers(self):
        return []


def fake_info(answers: dict[str, float | None]):
    """request_info whose peer answers after answers[peer] seconds (None: never; 'refused': at once with an error)."""

    async def request_info(p2p, peer, timeout):
        delay = answers[peer]
        if delay is None:
            await asyncio.sleep(3600)
        if delay == "refused":
            raise PeerUnavailable(f"could not reach server {peer}: connection refused")
        await asyncio.sleep(delay)
        return f"info of {peer}"

    return request_info


def ping(monkeypatch, answers, timeout, settle=True):
    monkeypatch.setattr(liveness, "request_info", fake_info(answers))
    monkeypatch.setattr(liveness, "SETTLE_FLOOR", 0.3)
    begin = time.monotonic()
    result = asyncio.run(liveness.ping_servers(FakeP2P(), list(answers), timeout, settle=settle))
    return result, time.monotonic() - begin


def test_a_silent_server_is_given_up_once_the_others_answered(monkeypatch):
    result, took = ping(monkeypatch, {"a": 0.01, "b": 0.02, "c": 0.01, "dead": None}, timeout=30.0)
    assert took < 5.0  # the floor (0.3 s), not the 30-s timeout
    assert [peer for peer, live in result.items() if live.reachable] == ["a", "b", "c"]
    assert not result["dead"].reachable
    assert "while 3 of 4 servers answered" in result["dead"].error
    assert result["a"].reply == "info of a" and result["a"].rtt is not None


def test_the_wait_scales_with_the_answers_round_trips(monkeypatch):
    """Answers of ~0.2 s: a ping out for 0.5 s is not given up yet (5 x the median is ~1 s)."""
    result, _ = ping(monkeypatch, {"a": 0.2, "b": 0.2, "c": 0.2, "late": 0.5}, timeout=30.0)
    assert all(live.reachable for live in result.values()), result


def test_without_a_majority_of_answers_the_timeout_decides(monkeypatch):
    result, took = ping(monkeypatch, {"a": 0.01, "dead1": None, "dead2": None}, timeout=1.0)
    assert took >= 0.9
    assert result["a"].reachable and not result["dead1"].reachable and not result["dead2"].reachable
    assert "within 1.0s" in result["dead1"].error


def test_settle_off_waits_for_the_timeout_and_refusals_stay_errors(monkeypatch):
    result, took = ping(monkeypatch, {"a": 0.01, "b": 0.01, "c": 0.01, "gone": "refused", "dead": None}, timeout=1.0,
                        settle=False)
    assert took >= 0.9
    assert "connection refused" in result["gone"].error
    assert "within 1.0s" in result["dead"].error


def test_a_caller_that_is_cancelled_cancels_every_ping(monkeypatch):
    monkeypatch.setattr(liveness, "request_info", fake_info({"a": None, "b": None}))

    async def run():
        task = asyncio.ensure_future(liveness.ping_servers(FakeP2P(), ["a", "b"], 30.0))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    assert asyncio.run(run()) == []


def test_a_server_with_announced_addresses_is_dialed_there_first(monkeypatch):
    """A server behind a NAT is reachable only through the relays its record names: p2pd learns them from the dial."""
    dialed = []

    async def dial(p2p, peer, maddrs, timeout):
        dialed.append((peer, tuple(maddrs)))
        return True

    monkeypatch.setattr(liveness, "dial", dial)
    monkeypatch.setattr(liveness, "request_info", fake_info({"direct": 0.01, "natted": 0.01}))
    circuit = ("/ip4/10.0.0.1/tcp/1/p2p/RELAY/p2p-circuit/p2p/natted",)
    result = asyncio.run(liveness.ping_servers(FakeP2P(), ["direct", "natted"], 5.0, maddrs={"natted": circuit}))
    assert dialed == [("natted", circuit)]
    assert result["natted"].reachable and result["direct"].reachable
