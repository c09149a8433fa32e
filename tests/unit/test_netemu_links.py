"""The emulated network's link model and packet parsing: exact release times, drops, firewalling."""

from __future__ import annotations

import struct

import pytest

from corolla.netemu.links import Link, LinkModel, parse_ipv4


def ipv4(src: str, dst: str, payload: bytes = b"", proto: int = 17, flags_offset: int = 0) -> bytes:
    header = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(payload), 0, flags_offset, 64, proto, 0,
                         bytes(int(x) for x in src.split(".")), bytes(int(x) for x in dst.split(".")))
    return header + payload


def tcp(flags: int) -> bytes:
    return struct.pack("!HHIIBBHHH", 1234, 80, 0, 0, 0x50, flags, 65535, 0, 0)


def test_parse_ipv4_reads_addresses_size_and_connection_opening_segments():
    syn = parse_ipv4(ipv4("10.77.0.1", "10.77.0.2", tcp(0x02), proto=6))
    assert syn is not None and (syn.src, syn.dst, syn.size, syn.opens_connection) == ("10.77.0.1", "10.77.0.2", 40, True)
    syn_ack = parse_ipv4(ipv4("10.77.0.2", "10.77.0.1", tcp(0x12), proto=6))
    assert syn_ack is not None and not syn_ack.opens_connection
    udp = parse_ipv4(ipv4("10.77.0.1", "10.77.0.2", b"x" * 30))
    assert udp is not None and udp.size == 50 and not udp.opens_connection
    later_fragment = parse_ipv4(ipv4("10.77.0.1", "10.77.0.2", tcp(0x02), proto=6, flags_offset=100))
    assert later_fragment is not None and not later_fragment.opens_connection


@pytest.mark.parametrize("data", [b"", b"\x45" * 10, b"\x60" + b"\x00" * 39, b"\x4f" + b"\x00" * 30])
def test_parse_ipv4_rejects_what_is_not_an_ipv4_packet(data):
    assert parse_ipv4(data) is None


def test_delay_is_the_sum_of_both_links_unless_the_pair_has_its_own():
    model = LinkModel({"a": Link(delay=0.010), "b": Link(delay=0.015), "c": Link(delay=0.0)})
    assert model.schedule(100.0, "a", "b", 1000) == pytest.approx(100.025)
    assert model.schedule(100.0, "b", "a", 1000) == pytest.approx(100.025)
    model.pair_delay[frozenset(("a", "b"))] = 0.002
    assert model.schedule(100.0, "a", "b", 1000) == pytest.approx(100.002)
    assert model.schedule(100.0, "a", "c", 1000) == pytest.approx(100.010)


def test_rate_serialises_packets_on_the_uplink_and_the_downlink():
    model = LinkModel({"a": Link(rate=1000.0), "b": Link(rate=500.0)})  # bytes/s
    # 100 bytes: 0.1 s on a's uplink, then 0.2 s on b's downlink
    assert model.schedule(0.0, "a", "b", 100) == pytest.approx(0.3)
    # the next packet waits for the first on both queues
    assert model.schedule(0.0, "a", "b", 100) == pytest.approx(0.5)
    # an idle link starts fresh
    assert model.schedule(10.0, "a", "b", 100) == pytest.approx(10.3)


def test_a_packet_that_would_queue_too_long_is_dropped():
    model = LinkModel({"a": Link(rate=1000.0), "b": Link()}, queue_limit=0.25)
    sent = [model.schedule(0.0, "a", "b", 100) for _ in range(5)]
    assert sent[:3] == pytest.approx([0.1, 0.2, 0.3]) and sent[3] is None and sent[4] is None
    assert model.schedule(0.3, "a", "b", 100) == pytest.approx(0.4)  # the queue drained meanwhile


def test_a_link_that_is_down_drops_everything_from_and_to_its_host():
    model = LinkModel({"a": Link(), "b": Link(up=False), "c": Link()})
    assert model.schedule(0.0, "a", "b", 10) is None
    assert model.schedule(0.0, "b", "a", 10) is None
    assert model.schedule(0.0, "a", "c", 10) == 0.0


def test_a_host_behind_a_nat_gets_no_new_connections_but_keeps_its_own():
    model = LinkModel({"home": Link(accept_inbound=False), "public": Link()})
    assert model.schedule(0.0, "public", "home", 40, opens_connection=True) is None
    assert model.schedule(0.0, "public", "home", 40) == 0.0  # segments of a connection `home` opened
    assert model.schedule(0.0, "home", "public", 40, opens_connection=True) == 0.0
