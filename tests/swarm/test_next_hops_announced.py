"""Servers measure round trips to their next hops and announce them (ServerInfo.next_pings) for push routing."""

from __future__ import annotations

import time

from corolla.dht import fetch_block_servers, model_dht_prefix
from hostile import LoopNode

ANNOUNCE_PERIOD = ["--announce-period", "1"]  # seconds: next hops are measured (and announced) this often


def test_a_server_announces_its_round_trip_to_the_server_after_it_within_a_few_periods(start_swarm):
    swarm = start_swarm(head=("0:2", ANNOUNCE_PERIOD), tail=("2:4", ANNOUNCE_PERIOD))
    head, tail = swarm.peer_ids["head"], swarm.peer_ids["tail"]
    node = LoopNode(swarm.peers)
    try:
        prefix = model_dht_prefix(swarm.model_path)
        deadline = time.monotonic() + 30.0
        while True:
            first, third = node.run(fetch_block_servers(node.node.dht, prefix, [0, 2]), timeout=30)
            pings = first[head].next_pings if head in first else {}
            if tail in pings or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert set(pings) == {tail}, f"head announced {pings} within 30 s"
        assert 0 < pings[tail] < 2.0  # seconds, over loopback; the ping timeout is 2 s
        assert third[tail].next_pings == {}  # the last blocks: a pushed step ends there, nobody to measure
    finally:
        node.close()
