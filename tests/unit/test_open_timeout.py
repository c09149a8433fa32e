"""SequenceManager.open_timeout: how long a new stream to a server may take to open, from its measured round trip
(a cut-off host never refuses, so without this every open to one waits the whole connect_timeout)."""

from __future__ import annotations

from types import SimpleNamespace

from corolla.client.config import ClientConfig
from corolla.client.swarm.sequence_manager import OPEN_TIMEOUT_FLOOR, OPEN_TIMEOUT_RTTS, SequenceManager


def manager(rtts: dict[str, float]) -> SequenceManager:
    node = SimpleNamespace(p2p=None, peer_id="me")
    m = SequenceManager(node, "model", 4, ClientConfig(connect_timeout=10.0))  # type: ignore[arg-type]
    m.rtts.update(rtts)
    return m


def test_nothing_measured_yet_gives_the_connect_timeout():
    assert manager({}).open_timeout("a") == 10.0


def test_a_measured_server_gets_its_round_trips_within_the_floor_and_the_connect_timeout():
    m = manager({"near": 0.01, "wan": 0.2, "far": 2.0})
    assert m.open_timeout("near") == OPEN_TIMEOUT_FLOOR  # 20 x 10 ms is under the floor
    assert m.open_timeout("wan") == OPEN_TIMEOUT_RTTS * 0.2
    assert m.open_timeout("far") == 10.0  # never more than connect_timeout


def test_a_server_not_measured_yet_is_taken_as_far_as_the_median_of_the_others():
    m = manager({"a": 0.15, "b": 0.2, "c": 0.3})
    assert m.open_timeout("new") == OPEN_TIMEOUT_RTTS * 0.2
