"""ServerInfo.next_pings on the wire (round trip, records without it) and server.presence.next_hops: which peers a server
measures, what it keeps and announces, and that a slow or failing peer holds nothing up."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from corolla.protocol.errors import PeerUnavailable, PeerUnreachable
from corolla.protocol.messages import MAX_PING_SECONDS, ServerInfo, ServerState
from corolla.server.presence import next_hops
from corolla.server.presence.next_hops import NextHops, next_hop_candidates
from test_routing import make_info


def test_next_pings_survive_the_dht_round_trip_and_old_records_parse_without_them():
    info = make_info(0, 2).model_copy(update={"next_pings": {"QmNext": 0.0125, "QmOther": 0.5}})
    stored = msgpack.unpackb(msgpack.packb(info.model_dump(mode="json")))  # as hivemind stores a record's value
    assert ServerInfo.model_validate(stored) == info
    old = make_info(0, 2).model_dump(mode="json")
    del old["next_pings"]  # a record of a server that predates next_pings
    assert ServerInfo.model_validate(old).next_pings == {}


class FakeNode:
    peer_id = "me"
    dht = None


def records(**servers: ServerInfo) -> dict[str, ServerInfo]:
    return dict(servers)


def test_candidates_are_online_servers_holding_the_next_block_those_starting_there_first():
    servers = records(me=make_info(0, 6), z_starts=make_info(4, 6), a_covers=make_info(2, 6), y_starts=make_info(4, 5),
                      off=make_info(4, 6, state=ServerState.OFFLINE), joining=make_info(4, 6, state=ServerState.JOINING),
                      before=make_info(1, 4))
    assert next_hop_candidates(servers, "me", 4) == ["y_starts", "z_starts", "a_covers"]
    assert next_hop_candidates(servers, "me", 4, max_peers=2) == ["y_starts", "z_starts"]
    many = {f"p{i:02d}": make_info(4, 6) for i in range(20)}
    assert next_hop_candidates(many, "me", 4) == [f"p{i:02d}" for i in range(8)]


def make_hops(monkeypatch, servers: dict[str, ServerInfo], answers, **kwargs) -> NextHops:
    """NextHops over a fake DHT holding `servers` for every block and pings answered by answers(peer)."""
    async def fetch(dht, prefix, blocks):
        return [dict(servers) for _ in blocks]

    async def ping(node, peer, maddrs, *, connect_timeout, timeout):
        return await answers(peer)

    monkeypatch.setattr(next_hops, "fetch_block_servers", fetch)
    monkeypatch.setattr(next_hops, "ping", ping)
    return NextHops(FakeNode(), "m", 8, **kwargs)  # type: ignore[arg-type]


def test_round_trips_are_smoothed_failing_peers_dropped_and_the_last_server_measures_nothing(monkeypatch):
    samples = {"good": [0.010, 0.020], "flaky": [0.010, None], "gone": [None, None]}

    async def answers(peer):
        sample = samples[peer].pop(0)
        if sample is None:
            raise PeerUnreachable(peer) if peer == "gone" else PeerUnavailable(peer)
        return sample

    servers = records(good=make_info(4, 8), flaky=make_info(4, 6), gone=make_info(4, 8))
    hops = make_hops(monkeypatch, servers, answers)
    asyncio.run(hops.refresh(4))
    assert hops.announced() == {"good": 0.010, "flaky": 0.010}
    asyncio.run(hops.refresh(4))
    assert hops.announced() == {"good": pytest.approx(0.015)}  # smoothed; flaky failed this time
    asyncio.run(hops.refresh(8))  # a server of the model's last blocks: no next hop
    assert hops.announced() == {}


def test_a_round_held_up_by_a_silent_peer_is_abandoned_in_time_and_keeps_what_was_measured_before(monkeypatch):
    async def answers(peer):
        if peer == "stuck":
            await asyncio.sleep(3600)
        return 0.004

    hops = make_hops(monkeypatch, records(fast=make_info(4, 8), stuck=make_info(4, 8)), answers, round_timeout=0.2)
    hops.pings = {"fast": 0.004}
    changed: list[bool] = []

    async def one_period():
        task = asyncio.create_task(hops.run(3600.0, lambda: 4, lambda: changed.append(True)))
        await asyncio.sleep(0.6)  # past the round's timeout: the loop now sleeps until the next period
        alive = not task.done()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return alive

    assert asyncio.run(one_period())
    assert hops.announced() == {"fast": 0.004} and changed == []


def test_announced_pings_stay_within_the_records_bounds(monkeypatch):
    hops = NextHops(FakeNode(), "m", 8)  # type: ignore[arg-type]
    hops.pings = {"slow": 1e6, "bad": float("nan"), "ok": 0.01}
    announced = hops.announced()
    assert announced == {"slow": MAX_PING_SECONDS, "ok": 0.01}
    ServerInfo.model_validate({**make_info(0, 2).model_dump(), "next_pings": announced})
    with pytest.raises(ValueError):
        NextHops(FakeNode(), "m", 8, max_peers=17)  # type: ignore[arg-type]


def test_the_next_servers_codecs_are_kept_for_pushes_of_many_positions(monkeypatch):
    """protocol.codecs.bulk_codec: a push of many positions goes deflated (lossless) to a next server whose record
    names "deflate"; one position, a lossy session codec, or a server that predates it: the session's codec."""
    from corolla.protocol.codecs import CODECS, bulk_codec

    async def answers(peer):
        return 0.01

    servers = records(new=make_info(4, 8).model_copy(update={"codecs": CODECS}), old=make_info(4, 8))
    hops = make_hops(monkeypatch, servers, answers)
    assert hops.codecs_of("new") == ("none",)  # nothing read yet
    asyncio.run(hops.refresh(4))
    assert "deflate" in hops.codecs_of("new") and hops.codecs_of("old") == ("none",)
    assert hops.codecs_of("elsewhere") == ("none",)  # not a server of the next block
    prompt, token = 5, 1  # positions
    assert bulk_codec("none", prompt, hops.codecs_of("new")) == "deflate"
    assert bulk_codec("none", token, hops.codecs_of("new")) == "none"
    assert bulk_codec("none", prompt, hops.codecs_of("old")) == "none"
    assert bulk_codec("int8", prompt, hops.codecs_of("new")) == "int8"
    asyncio.run(hops.refresh(8))  # the model's last blocks: nobody to push to
    assert hops.codecs_of("new") == ("none",)
