"""Multiaddrs as corolla handles them: which ones to tell peers, circuit-relay addresses, and bytes p2pd accepts.

Pure functions of strings. Why `to_daemon_bytes` exists: hivemind's Python multiaddr codec writes a /p2p/ peer id as
a CID (a 2-byte prefix before the multihash), which p2pd's Go parser rejects ("length greater than remaining
number of bytes"); p2pd wants the bare multihash. Dialing a peer at explicit addresses (e.g. through a relay)
goes through the daemon's CONNECT request, so those bytes must be right.
"""

from __future__ import annotations

import ipaddress
from typing import Iterable, Sequence

import base58

# multicodec codes (https://github.com/multiformats/multicodec/blob/master/table.csv)
_CODES = {"ip4": 4, "tcp": 6, "udp": 273, "ip6": 41, "dns": 53, "dns4": 54, "dns6": 55, "p2p": 421, "ipfs": 421,
          "p2p-circuit": 290, "quic": 460, "quic-v1": 461}
_NO_VALUE = {"p2p-circuit", "quic", "quic-v1"}
MAX_MADDR_CHARS = 512


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def to_daemon_bytes(maddr: str) -> bytes:
    """The binary multiaddr of `maddr` as p2pd parses it; ValueError for a malformed or unsupported one."""
    parts = maddr.strip().strip("/").split("/")
    if not maddr.strip().startswith("/") or not parts or parts == [""]:
        raise ValueError(f"not a multiaddr: {maddr!r}")
    out, i = b"", 0
    while i < len(parts):
        name = parts[i]
        if name not in _CODES:
            raise ValueError(f"unsupported protocol {name!r} in {maddr!r}")
        out += _varint(_CODES[name])
        if name in _NO_VALUE:
            i += 1
            continue
        if i + 1 >= len(parts):
            raise ValueError(f"{name} without a value in {maddr!r}")
        value = parts[i + 1]
        try:
            if name == "ip4":
                out += ipaddress.IPv4Address(value).packed
            elif name == "ip6":
                out += ipaddress.IPv6Address(value).packed
            elif name in ("tcp", "udp"):
                port = int(value)
                if not 0 <= port < 65536:
                    raise ValueError(f"port {port} out of range")
                out += port.to_bytes(2, "big")
            elif name in ("p2p", "ipfs"):
                multihash = base58.b58decode(value)
                out += _varint(len(multihash)) + multihash
            else:  # dns names
                out += _varint(len(value.encode())) + value.encode()
        except ValueError as e:
            raise ValueError(f"bad {name} value {value!r} in {maddr!r}: {e}") from None
        i += 2
    return out


def peer_id_of(maddr: str) -> str | None:
    """The peer id a multiaddr ends with (/p2p/<id>), else None."""
    parts = maddr.rstrip("/").split("/")
    return parts[-1] if len(parts) >= 2 and parts[-2] in ("p2p", "ipfs") else None


def is_circuit(maddr: str) -> bool:
    return "/p2p-circuit" in maddr


def is_loopback(maddr: str) -> bool:
    parts = maddr.split("/")
    for proto, value in zip(parts, parts[1:]):
        if proto in ("ip4", "ip6"):
            try:
                return ipaddress.ip_address(value).is_loopback
            except ValueError:
                return False
    return False


def is_unspecified(maddr: str) -> bool:
    parts = maddr.split("/")
    for proto, value in zip(parts, parts[1:]):
        if proto in ("ip4", "ip6"):
            try:
                return ipaddress.ip_address(value).is_unspecified
            except ValueError:
                return False
    return False


def dialable(maddrs: Iterable[str]) -> list[str]:
    """The addresses worth telling other machines, best first: never 0.0.0.0/::, loopback only when there is
    nothing else (a swarm on one machine), duplicates dropped, order otherwise kept."""
    seen: list[str] = []
    for maddr in maddrs:
        if maddr not in seen and not is_unspecified(maddr):
            seen.append(maddr)
    outside = [m for m in seen if not is_loopback(m)]
    return outside if outside else seen


def circuit_maddrs(relays: Sequence[str], peer_id: str) -> list[str]:
    """Where a peer that holds a reservation at each of `relays` (full multiaddrs of the relays) can be dialed:
    <relay maddr>/p2p-circuit/p2p/<peer_id>."""
    out = []
    for relay in relays:
        if peer_id_of(relay) is None:
            raise ValueError(f"relay {relay!r} is not a full multiaddr (expected /ip4/HOST/tcp/PORT/p2p/PEERID)")
        out.append(f"{relay.rstrip('/')}/p2p-circuit/p2p/{peer_id}")
    return out
