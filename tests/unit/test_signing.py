"""Peer keys and signatures (protocol.signing): a statement checks only against its signer's peer id and label."""

from __future__ import annotations


from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

from corolla.dht.identity import ephemeral_identity
from corolla.protocol.signing import PeerKey, embedded_public_key, peer_id_of, verify


def test_an_ed25519_signature_checks_against_the_peer_id_alone():
    key = PeerKey.generate()
    assert key.peer_id.startswith("12D3KooW") and embedded_public_key(key.peer_id) == key.public_key
    signature = key.sign("corolla/test/v1", b"payload")
    assert verify(key.peer_id, "corolla/test/v1", b"payload", signature)


def test_a_signature_does_not_check_for_another_payload_label_or_peer():
    key, other = PeerKey.generate(), PeerKey.generate()
    signature = key.sign("corolla/test/v1", b"payload")
    assert not verify(key.peer_id, "corolla/test/v1", b"payloaD", signature)
    assert not verify(key.peer_id, "corolla/other/v1", b"payload", signature)
    assert not verify(other.peer_id, "corolla/test/v1", b"payload", signature)
    assert not verify(key.peer_id, "corolla/test/v1", b"payload", signature[:-1] + bytes([signature[-1] ^ 1]))


def test_an_rsa_identity_signs_with_its_public_key_sent_along():
    data = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes()).SerializeToString()
    key = PeerKey.from_identity(data)
    assert key.peer_id.startswith("Qm") and not key.is_inline
    assert peer_id_of(key.public_key) == key.peer_id
    signature = key.sign("corolla/test/v1", b"x")
    assert not verify(key.peer_id, "corolla/test/v1", b"x", signature)  # the id alone cannot tell the key
    assert verify(key.peer_id, "corolla/test/v1", b"x", signature, key.public_key)
    impostor = PeerKey.generate()
    assert not verify(key.peer_id, "corolla/test/v1", b"x", impostor.sign("corolla/test/v1", b"x"), impostor.public_key)


def test_garbage_is_never_a_valid_signature():
    key = PeerKey.generate()
    for peer_id, signature, public_key in [("not-a-peer-id", b"x", None), (key.peer_id, b"", None),
                                           (key.peer_id, b"\x00" * 5000, None), ("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", b"x", b"junk")]:
        assert not verify(peer_id, "corolla/test/v1", b"x", signature, public_key)


def test_an_identity_round_trips_through_its_file_bytes():
    key = PeerKey.generate()
    assert PeerKey.from_identity(key.to_identity()).peer_id == key.peer_id
    with ephemeral_identity(key) as path:
        with open(path, "rb") as f:
            assert PeerKey.from_identity(f.read()).peer_id == key.peer_id
