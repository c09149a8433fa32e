"""Private swarms: the key file, the DHT RPC authorizer (forgery, tampering, replay, clocks) and the membership gate."""

from __future__ import annotations

import asyncio
import os
import stat

import pytest
from hivemind.proto import dht_pb2
from hivemind.utils.timed_storage import get_dht_time

from corolla.membership import MembershipGate, SwarmKey, SwarmKeyAuthorizer, generate_swarm_key, load_swarm_key
from corolla.membership.gate import NONCE_BYTES, proof_for


def test_a_generated_key_file_is_private_reloads_identically_and_is_never_overwritten(tmp_path):
    path = tmp_path / "swarm.key"
    key = generate_swarm_key(str(path))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert path.read_text().splitlines()[:2] == ["/key/swarm/psk/1.0.0/", "/base16/"]
    assert load_swarm_key(str(path)) == key
    with pytest.raises(FileExistsError):
        generate_swarm_key(str(path))
    assert load_swarm_key(str(path)) == key


@pytest.mark.parametrize("text", ["", "hello", "/key/swarm/psk/1.0.0/\n/base16/\nzz\n",
                                  "/key/swarm/psk/1.0.0/\n/base16/\n" + "ab" * 16 + "\n",
                                  "/key/swarm/psk/1.0.0/\n/base64/\n" + "ab" * 32 + "\n"])
def test_loading_something_else_names_the_file(tmp_path, text):
    path = tmp_path / "not-a-key"
    path.write_text(text)
    with pytest.raises(ValueError, match="not-a-key"):
        load_swarm_key(str(path))


def test_macs_depend_on_the_key_the_label_and_part_boundaries():
    key, other = SwarmKey(b"k" * 32), SwarmKey(b"o" * 32)
    assert key.mac("x", b"ab", b"c") == key.mac("x", b"ab", b"c")
    assert key.mac("x", b"ab", b"c") != key.mac("x", b"a", b"bc")
    assert key.mac("x", b"abc") != key.mac("y", b"abc") != other.mac("x", b"abc")
    assert key.check("x", key.mac("x", b"abc"), b"abc") and not key.check("x", other.mac("x", b"abc"), b"abc")
    assert "k" * 8 not in repr(key)


def find_request() -> dht_pb2.FindRequest:
    return dht_pb2.FindRequest(keys=[b"some key"], peer=dht_pb2.NodeInfo(node_id=b"node"))


def run(coro):
    return asyncio.run(coro)


def test_members_accept_each_others_dht_requests_and_responses():
    member, other_member = SwarmKeyAuthorizer(SwarmKey(b"k" * 32)), SwarmKeyAuthorizer(SwarmKey(b"k" * 32))
    request = find_request()
    run(member.sign_request(request, None))
    assert run(other_member.validate_request(request))
    response = dht_pb2.FindResponse(peer=dht_pb2.NodeInfo(node_id=b"them"))
    run(other_member.sign_response(response, request))
    assert run(member.validate_response(response, request))


def test_strangers_requests_and_answers_are_refused():
    member, stranger = SwarmKeyAuthorizer(SwarmKey(b"k" * 32)), SwarmKeyAuthorizer(SwarmKey(b"s" * 32))
    request = find_request()
    run(stranger.sign_request(request, None))
    assert not run(member.validate_request(request))
    unsigned = find_request()
    assert not run(member.validate_request(unsigned))
    own = find_request()
    run(member.sign_request(own, None))
    forged = dht_pb2.FindResponse(peer=dht_pb2.NodeInfo(node_id=b"liar"))
    run(stranger.sign_response(forged, own))
    assert not run(member.validate_response(forged, own))


def test_tampered_replayed_or_stale_requests_are_refused():
    key = SwarmKey(b"k" * 32)
    sender, receiver = SwarmKeyAuthorizer(key), SwarmKeyAuthorizer(key)
    request = find_request()
    run(sender.sign_request(request, None))
    tampered = dht_pb2.FindRequest()
    tampered.CopyFrom(request)
    tampered.keys[0] = b"other key"
    assert not run(receiver.validate_request(tampered))
    assert run(receiver.validate_request(request))
    assert not run(receiver.validate_request(request))  # the same request again: a replay
    stale = find_request()
    run(sender.sign_request(stale, None))
    stale.auth.time = get_dht_time() - 3600
    stale.auth.signature = b""
    stale.auth.signature = key.mac("corolla/dht-request/v1", stale.SerializeToString(deterministic=True))
    assert not run(receiver.validate_request(stale))


def test_a_response_must_answer_this_very_request():
    key = SwarmKey(b"k" * 32)
    client, server = SwarmKeyAuthorizer(key), SwarmKeyAuthorizer(key)
    first, second = find_request(), find_request()
    run(client.sign_request(first, None))
    run(client.sign_request(second, None))
    response = dht_pb2.FindResponse()
    run(server.sign_response(response, first))
    assert run(client.validate_response(response, first))
    assert not run(client.validate_response(response, second))


class FakePeerId:
    def __init__(self, name: str):
        self.name = name

    def to_base58(self) -> str:
        return self.name


class FakeP2P:
    """Answers membership challenges in memory: each peer name maps to the key it proves with (None: no handler)."""

    def __init__(self, me: str, peers: dict[str, SwarmKey | None], delay: float = 0.0):
        self.peer_id = FakePeerId(me)
        self.peers = peers
        self.delay = delay
        self.calls = 0

    async def call_binary_stream_handler(self, peer_id, name):
        self.calls += 1
        await asyncio.sleep(self.delay)
        prover = peer_id.to_base58()
        key = self.peers[prover]
        if key is None:
            raise ConnectionError("protocol not supported")
        reader, writer = asyncio.StreamReader(), FakeWriter()
        writer.answer = lambda nonce: reader.feed_data(proof_for(key, nonce, prover, self.peer_id.to_base58()))
        return None, reader, writer


class FakeWriter:
    answer = None

    def write(self, data: bytes) -> None:
        assert len(data) == NONCE_BYTES
        self.answer(data)

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture
def patched_peer_ids(monkeypatch):
    monkeypatch.setattr("corolla.membership.gate.PeerID.from_base58", FakePeerId)


def test_the_gate_admits_members_once_per_ttl_and_refuses_others(patched_peer_ids):
    key = SwarmKey(b"k" * 32)
    p2p = FakeP2P("server", {"member": key, "stranger": SwarmKey(b"s" * 32), "bare": None})

    async def scenario():
        gate = MembershipGate(p2p, key, proven_ttl=60.0, refused_ttl=60.0)  # type: ignore[arg-type]
        verdicts = [await gate.authorize(p) for p in ("member", "member", "stranger", "stranger", "bare", "server")]
        return verdicts, gate.challenges

    verdicts, challenges = asyncio.run(scenario())
    assert verdicts == [True, True, False, False, False, True]
    assert challenges == 3  # member, stranger and bare once each; ourselves never


def test_concurrent_streams_of_one_peer_share_one_challenge(patched_peer_ids):
    key = SwarmKey(b"k" * 32)
    p2p = FakeP2P("server", {"member": key}, delay=0.05)

    async def scenario():
        gate = MembershipGate(p2p, key)  # type: ignore[arg-type]
        return await asyncio.gather(*(gate.authorize("member") for _ in range(10)))

    assert asyncio.run(scenario()) == [True] * 10 and p2p.calls == 1


def test_a_refusal_is_forgotten_after_refused_ttl(patched_peer_ids):
    key = SwarmKey(b"k" * 32)
    peers: dict[str, SwarmKey | None] = {"late": None}
    p2p = FakeP2P("server", peers)

    async def scenario():
        gate = MembershipGate(p2p, key, refused_ttl=0.01)  # type: ignore[arg-type]
        first = await gate.authorize("late")
        peers["late"] = key  # e.g. restarted with --swarm-key
        await asyncio.sleep(0.05)
        return first, await gate.authorize("late")

    assert asyncio.run(scenario()) == (False, True)
