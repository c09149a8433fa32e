"""The emulated network's physics, as pure functions of plain data: when does a packet arrive, or is it lost.

Every host hangs off the switch by one link:

    host A --(delay d_A, rate r_A)--> switch --(delay d_B, rate r_B)--> host B

so a packet from A to B takes d_A + d_B seconds one way (a pair override replaces that sum), plus the time to
serialise it onto A's uplink and B's downlink at their rates. Each direction of each link is a FIFO: a packet
waits for the ones queued before it, and one that would wait longer than `queue_limit` seconds is dropped (a
router's finite buffer; it also bounds the switch's memory). The downlink queue is reserved when the packet enters
the switch, not when it reaches the downlink, so two sources with different delays may be scheduled slightly out of
order there; at the few Mbit/s to Gbit/s the tests use, this is far below a millisecond.

A link that is down drops every packet from or to its host (a cable pulled: nothing is delivered, nothing is
refused, senders time out). A host that does not accept inbound connections is firewalled like a home NAT: TCP
segments opening a connection to it (SYN without ACK) are dropped; connections it opens itself work both ways.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

TCP = 6
SYN = 0x02
ACK = 0x10


@dataclass
class Link:
    """One host's attachment to the switch."""

    delay: float = 0.0  # one-way seconds between this host and the switch
    rate: float | None = None  # bytes/s in each direction; None = unlimited
    up: bool = True  # False: every packet from or to this host is dropped
    accept_inbound: bool = True  # False: TCP connection attempts to this host are dropped (behind a NAT)


@dataclass(frozen=True)
class Packet:
    """The parts of an IPv4 packet the switch looks at."""

    src: str  # dotted quad
    dst: str
    size: int  # bytes on the wire
    opens_connection: bool  # a TCP SYN without ACK


def parse_ipv4(data: bytes) -> Packet | None:
    """The switch's view of `data`, or None when it is not a well-formed IPv4 packet (IPv6, garbage)."""
    if len(data) < 20 or data[0] >> 4 != 4:
        return None
    header_len = (data[0] & 0x0F) * 4
    if header_len < 20 or len(data) < header_len:
        return None
    src = ".".join(str(b) for b in data[12:16])
    dst = ".".join(str(b) for b in data[16:20])
    opens = False
    fragment_offset = struct.unpack("!H", data[6:8])[0] & 0x1FFF
    if data[9] == TCP and fragment_offset == 0 and len(data) >= header_len + 14:
        flags = data[header_len + 13]
        opens = bool(flags & SYN) and not flags & ACK
    return Packet(src, dst, len(data), opens)


@dataclass
class LinkModel:
    """Link state of every host and the FIFO queues of both directions of each link.

    `schedule` is the whole decision: it returns the absolute time (same clock as `now`) at which a packet must be
    written to its destination, or None when it is dropped. It never reads a clock itself.
    """

    links: dict[str, Link]
    pair_delay: dict[frozenset[str], float] = field(default_factory=dict)  # one-way seconds for a pair of hosts
    queue_limit: float = 0.5  # seconds a packet may wait in one queue before it is dropped
    _uplink_free: dict[str, float] = field(default_factory=dict)  # when each host's uplink finishes its queue
    _downlink_free: dict[str, float] = field(default_factory=dict)

    def one_way_delay(self, src: str, dst: str) -> float:
        """Propagation delay from src to dst, seconds (a pair override, else the sum of both links' delays)."""
        pair = frozenset((src, dst))
        if pair in self.pair_delay:
            return self.pair_delay[pair]
        return self.links[src].delay + self.links[dst].delay

    def schedule(self, now: float, src: str, dst: str, size: int, opens_connection: bool = False) -> float | None:
        """Release time of a `size`-byte packet from host src to host dst entering the switch at `now`."""
        a, b = self.links[src], self.links[dst]
        if not a.up or not b.up or (opens_connection and not b.accept_inbound):
            return None
        sent = self._enqueue(self._uplink_free, src, a.rate, now, size)
        if sent is None:
            return None
        return self._enqueue(self._downlink_free, dst, b.rate, sent + self.one_way_delay(src, dst), size)

    def _enqueue(
        self, free_at: dict[str, float], host: str, rate: float | None, arrival: float, size: int
    ) -> float | None:
        if rate is None:
            return arrival
        start = max(arrival, free_at.get(host, arrival))
        if start - arrival > self.queue_limit:
            return None
        free_at[host] = start + size / rate
        return free_at[host]
