"""`corolla dht --identity`: the same peer id and multiaddr after a restart (on 127.0.0.1: runs without root)."""

from __future__ import annotations

import os
import socket
import stat

from corolla.netemu.process import HostProcess
from corolla.netemu.swarm import corolla


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_dht(*args: str) -> list[str]:
    proc = HostProcess.start("dht", corolla("dht", *args), dict(os.environ))
    try:
        proc.wait_for(r"DHT peer .* running", timeout=120)
        return [line for line in proc.log if line.startswith("/ip4/")]
    finally:
        assert proc.stop() == 0, proc.tail()


def test_a_dht_peer_restarted_with_its_identity_keeps_its_multiaddr(tmp_path):
    identity, port = tmp_path / "dht.key", str(free_port())
    first = run_dht("--identity", str(identity), "--port", port)
    assert stat.S_IMODE(os.stat(identity).st_mode) == 0o600
    assert len(first) == 1 and first[0].startswith(f"/ip4/127.0.0.1/tcp/{port}/p2p/12D3KooW"), first
    assert run_dht("--identity", str(identity), "--port", port) == first
    assert run_dht("--port", str(free_port()))[0].split("/p2p/")[1] != first[0].split("/p2p/")[1]


def test_a_malformed_announce_address_is_refused_with_a_clear_error(tmp_path):
    proc = HostProcess.start("dht", corolla("dht", "--announce-maddrs", "/ip4/1.2.3.4/tcp/notaport"), dict(os.environ))
    assert proc.popen.wait(timeout=120) == 2
    proc.wait_for("corolla dht: error: .*notaport", timeout=10)
