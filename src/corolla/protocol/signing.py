"""Peer keys and signatures: what a peer says about itself or about others is bound to its peer id.

A libp2p peer id is derived from its public key: for an Ed25519 key the id *contains* the key (an identity
multihash of the 36-byte protobuf `PublicKey`, base58 "12D3KooW..."), for an RSA key it is the SHA-256 multihash of
it ("Qm..."). So a signature can be checked against a peer id alone (Ed25519), or against a public key that the
signer sends along and that must hash to the peer id (RSA). Either way only the holder of the peer id's private key
can produce a signature that `verify` accepts for that peer id.

Every signature covers a *label* (what the statement is, e.g. "corolla/dht-record/v1") followed by the payload,
so a signature made for one purpose can never be replayed as another.

New keys are Ed25519 (signing ~50 us, verifying ~120 us here; RSA-2048 takes ~1.5 ms to sign). Identity files of
older corolla versions hold RSA keys; they keep working, with larger records and slower signatures.
"""

from __future__ import annotations

import hashlib

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, padding, rsa
from hivemind.proto import crypto_pb2

_IDENTITY_MULTIHASH = 0x00  # multihash code of an inlined ("identity") digest
_SHA256_MULTIHASH = 0x12
_MAX_INLINE_KEY = 42  # libp2p inlines public keys of at most this many bytes into the peer id
MAX_PUBLIC_KEY_BYTES = 1024  # an RSA-4096 protobuf public key is ~550 bytes
MAX_SIGNATURE_BYTES = 1024


class PeerKey:
    """A peer's private key (Ed25519 or RSA): its peer id, its public key as libp2p encodes it, and `sign`."""

    def __init__(self, private_key: ed25519.Ed25519PrivateKey | rsa.RSAPrivateKey):
        self._key = private_key
        if isinstance(private_key, ed25519.Ed25519PrivateKey):
            raw = private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
            self.public_key = crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.Ed25519, data=raw).SerializeToString()
        else:
            der = private_key.public_key().public_bytes(serialization.Encoding.DER,
                                                        serialization.PublicFormat.SubjectPublicKeyInfo)
            self.public_key = crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.RSA, data=der).SerializeToString()
        self.peer_id = peer_id_of(self.public_key)

    @classmethod
    def generate(cls) -> PeerKey:
        """A new Ed25519 key."""
        return cls(ed25519.Ed25519PrivateKey.generate())

    @classmethod
    def from_identity(cls, data: bytes) -> PeerKey:
        """The key of a libp2p `PrivateKey` protobuf (an identity file, as p2pd reads it with `-id`).

        Raises ValueError for anything else."""
        try:
            message = crypto_pb2.PrivateKey.FromString(data)
            if message.key_type == crypto_pb2.KeyType.Ed25519:
                if len(message.data) not in (32, 64):
                    raise ValueError(f"an Ed25519 key has 32 or 64 bytes, not {len(message.data)}")
                return cls(ed25519.Ed25519PrivateKey.from_private_bytes(message.data[:32]))
            if message.key_type == crypto_pb2.KeyType.RSA:
                key = serialization.load_der_private_key(message.data, password=None)
                if not isinstance(key, rsa.RSAPrivateKey):
                    raise ValueError("the RSA key field holds another kind of key")
                return cls(key)
        except ValueError:
            raise
        except Exception as e:  # protobuf and DER parsers raise assorted types
            raise ValueError(f"not a libp2p private key: {e}") from e
        raise ValueError(f"unsupported key type {message.key_type} (corolla reads Ed25519 and RSA keys)")

    @property
    def is_inline(self) -> bool:
        """Whether the peer id contains the public key (Ed25519): signatures then need no key sent along."""
        return embedded_public_key(self.peer_id) is not None

    def to_identity(self) -> bytes:
        """The libp2p `PrivateKey` protobuf of this key (what an identity file holds)."""
        if isinstance(self._key, ed25519.Ed25519PrivateKey):
            seed = self._key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                           serialization.NoEncryption())
            raw = self._key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
            return crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=seed + raw).SerializeToString()
        der = self._key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL,
                                      serialization.NoEncryption())
        return crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=der).SerializeToString()

    def sign(self, label: str, payload: bytes) -> bytes:
        """A signature of `payload` for the purpose `label`, checkable with `verify(self.peer_id, ...)`."""
        data = _signed_bytes(label, payload)
        if isinstance(self._key, ed25519.Ed25519PrivateKey):
            return self._key.sign(data)
        return self._key.sign(data, padding.PKCS1v15(), hashes.SHA256())


def peer_id_of(public_key: bytes) -> str:
    """The base58 peer id of a libp2p protobuf `PublicKey`."""
    if len(public_key) <= _MAX_INLINE_KEY:
        multihash = bytes([_IDENTITY_MULTIHASH, len(public_key)]) + public_key
    else:
        multihash = bytes([_SHA256_MULTIHASH, 32]) + hashlib.sha256(public_key).digest()
    return base58.b58encode(multihash).decode()


def embedded_public_key(peer_id: str) -> bytes | None:
    """The protobuf public key inlined in `peer_id` (Ed25519 ids), or None (RSA ids, or not a peer id)."""
    try:
        raw = base58.b58decode(peer_id)
    except ValueError:
        return None
    if len(raw) < 2 or raw[0] != _IDENTITY_MULTIHASH or raw[1] != len(raw) - 2:
        return None
    return raw[2:]


def verify(peer_id: str, label: str, payload: bytes, signature: bytes, public_key: bytes | None = None) -> bool:
    """Whether `signature` is peer `peer_id`'s signature of `payload` for `label`. `public_key` (a libp2p protobuf
    `PublicKey`) is needed only for peer ids that do not contain their key (RSA); it must hash to `peer_id`.

    Never raises: anything malformed is simply not a valid signature."""
    if not isinstance(signature, bytes) or len(signature) > MAX_SIGNATURE_BYTES:
        return False
    key_bytes = embedded_public_key(peer_id)
    if key_bytes is None:
        if public_key is None or len(public_key) > MAX_PUBLIC_KEY_BYTES or peer_id_of(public_key) != peer_id:
            return False
        key_bytes = public_key
    try:
        message = crypto_pb2.PublicKey.FromString(key_bytes)
        data = _signed_bytes(label, payload)
        if message.key_type == crypto_pb2.KeyType.Ed25519:
            ed25519.Ed25519PublicKey.from_public_bytes(message.data).verify(signature, data)
            return True
        if message.key_type == crypto_pb2.KeyType.RSA:
            key = serialization.load_der_public_key(message.data)
            if not isinstance(key, rsa.RSAPublicKey):
                return False
            key.verify(signature, data, padding.PKCS1v15(), hashes.SHA256())
            return True
    except (InvalidSignature, ValueError, TypeError):
        return False
    except Exception:  # a malformed protobuf: not a valid signature either
        return False
    return False


def _signed_bytes(label: str, payload: bytes) -> bytes:
    encoded = label.encode()
    return len(encoded).to_bytes(2, "big") + encoded + payload
