"""Multiaddr handling: the bytes p2pd accepts, which addresses are told to peers, relayed addresses."""

from __future__ import annotations

import pytest
from hivemind.utils.multiaddr import Multiaddr

from corolla.dht.maddrs import circuit_maddrs, dialable, is_loopback, peer_id_of, to_daemon_bytes

PEER = "QmPwEWLmYeWoUX88X9iVQ82fPKE4G9hfSFdTVUTCcu9kNy"
RELAY = "12D3KooWJkyVzXiynjCRsW5t2xpWRWf8V8k5nbTbnkSDLxjBtnXF"


def test_daemon_bytes_follow_the_multiaddr_spec():
    # ip4 (04) 10.77.0.1, tcp (06) port 4001 (0x0fa1)
    assert to_daemon_bytes("/ip4/10.77.0.1/tcp/4001") == bytes.fromhex("040a4d0001060fa1")
    assert to_daemon_bytes("/ip4/10.77.0.1/tcp/4001") == Multiaddr("/ip4/10.77.0.1/tcp/4001").to_bytes()
    # p2p (a503), then the bare multihash with its length 34 (22), not a CID: sha2-256 (12) of 32 bytes (20)
    encoded = to_daemon_bytes(f"/ip4/10.77.0.1/tcp/4001/p2p/{PEER}")
    assert encoded[:13] == bytes.fromhex("040a4d0001060fa1a503221220") and len(encoded) == 8 + 2 + 1 + 34
    # p2p-circuit (a202) has no value
    circuit = to_daemon_bytes(f"/ip4/10.77.0.1/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{PEER}")
    assert bytes.fromhex("a202a503") in circuit


@pytest.mark.parametrize("bad", ["", "ip4/1.2.3.4", "/ip4/300.1.1.1/tcp/1", "/ip4/1.2.3.4/tcp/70000",
                                 "/ip4/1.2.3.4/tcp", "/foo/1", "/ip4/1.2.3.4/tcp/1/p2p/0OIl"])
def test_daemon_bytes_refuse_malformed_addresses(bad):
    with pytest.raises(ValueError):
        to_daemon_bytes(bad)


def test_dialable_never_offers_unspecified_and_offers_loopback_only_when_alone():
    outside = f"/ip4/10.77.0.2/tcp/5/p2p/{PEER}"
    loop = f"/ip4/127.0.0.1/tcp/5/p2p/{PEER}"
    anywhere = f"/ip4/0.0.0.0/tcp/5/p2p/{PEER}"
    assert dialable([loop, anywhere, outside, outside]) == [outside]
    assert dialable([anywhere, loop]) == [loop]
    assert is_loopback(loop) and not is_loopback(outside)


def test_circuit_addresses_go_through_each_relay_to_the_peer():
    relay = f"/ip4/10.77.0.1/tcp/4001/p2p/{RELAY}"
    assert circuit_maddrs([relay], PEER) == [f"{relay}/p2p-circuit/p2p/{PEER}"]
    assert peer_id_of(circuit_maddrs([relay], PEER)[0]) == PEER
    with pytest.raises(ValueError):
        circuit_maddrs(["/ip4/10.77.0.1/tcp/4001"], PEER)
