"""Identity files, announce retry delays and rejoin backoff: pure parts of staying reachable."""

from __future__ import annotations

import os
import stat

import pytest

from corolla.dht.identity import load_or_create_identity
from corolla.dht.watch import next_backoff
from corolla.server.presence.announcer import retry_delay


def test_an_identity_file_is_created_private_and_gives_the_same_peer_id_every_time(tmp_path):
    path = tmp_path / "peer.key"
    first = load_or_create_identity(str(path)).peer_id
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_or_create_identity(str(path)).peer_id == first
    other = load_or_create_identity(str(tmp_path / "other.key")).peer_id
    assert other != first and first.startswith("12D3KooW")  # Ed25519: the id holds the public key


def test_identity_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_or_create_identity(str(tmp_path / "missing-dir" / "peer.key"))
    garbage = tmp_path / "garbage.key"
    garbage.write_bytes(b"not a key")
    with pytest.raises(ValueError, match="garbage.key"):
        load_or_create_identity(str(garbage))


def test_failed_announces_are_retried_sooner_than_the_period():
    assert [retry_delay(f, 30.0) for f in range(8)] == [30.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert [retry_delay(f, 2.0) for f in range(4)] == [2.0, 1.0, 2.0, 2.0]


def test_rejoin_backoff_doubles_from_the_period_up_to_its_cap():
    waits, wait = [], 5.0
    for _ in range(5):
        wait = next_backoff(wait, 5.0, 30.0)
        waits.append(wait)
    assert waits == [10.0, 20.0, 30.0, 30.0, 30.0]
    assert next_backoff(0.0, 5.0, 30.0) == 5.0


class _FakeNode:
    """Just what SwarmWatch reads: a routing table, the initial peers, and a dialer that always fails."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.table: dict = {}
        async def call_ping(peer: object) -> None:
            return None

        protocol = SimpleNamespace(routing_table=SimpleNamespace(peer_id_to_uid=self.table), call_ping=call_ping)
        self.dht = SimpleNamespace(protocol=protocol, blacklist=set())
        self.initial_peers = ["/ip4/10.0.0.1/tcp/1/p2p/QmBoot"]
        self.initial_peer_ids = {"/ip4/10.0.0.1/tcp/1/p2p/QmBoot": "QmBoot"}  # missing from the table: pinged
        self.peer_id = "QmSelf"

    async def connect(self, peer_id: str, maddrs: list[str]) -> bool:
        return False


def test_a_node_brought_back_by_another_path_counts_as_rejoined_and_reannounces(monkeypatch, caplog):
    """Cut off, then back in the routing table without a rejoin attempt of its own (its announce reached a peer):
    the watch logs the rejoin and runs on_rejoined, instead of staying in its 'cut off' state."""
    import asyncio
    import logging

    from corolla.dht.watch import SwarmWatch

    node = _FakeNode()
    watch = SwarmWatch(node, period=1.0)  # type: ignore[arg-type]
    calls: list[str] = []

    async def failing_rejoin() -> bool:
        calls.append("rejoin")
        return False

    async def reannounce() -> None:
        calls.append("announce")

    monkeypatch.setattr(watch, "rejoin", failing_rejoin)
    watch.on_rejoined.append(reannounce)
    monkeypatch.setattr(watch, "routing_peers", lambda: list(node.table))

    async def scenario() -> None:
        assert await watch.check() is False  # nobody in the table: cut off, the rejoin attempt fails
        node.table["QmOther"] = 1
        assert await watch.check() is True

    with caplog.at_level(logging.INFO, logger="corolla.dht.watch"):
        asyncio.run(scenario())
    assert calls == ["rejoin", "announce"] and watch.rejoins == 1
    assert any("rejoined the swarm" in r.getMessage() for r in caplog.records)
