"""Identity files, announce retry delays and rejoin backoff: pure parts of staying reachable."""

from __future__ import annotations

import os
import stat

import pytest

from corolla.dht.identity import load_or_create_identity
from corolla.dht.watch import next_backoff
from corolla.server.announcer import retry_delay


def test_an_identity_file_is_created_private_and_gives_the_same_peer_id_every_time(tmp_path):
    path = tmp_path / "peer.key"
    first = load_or_create_identity(str(path))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_or_create_identity(str(path)) == first
    other = load_or_create_identity(str(tmp_path / "other.key"))
    assert other != first and first.startswith("Qm")


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
