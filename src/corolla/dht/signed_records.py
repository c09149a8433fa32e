"""Signed, owner-bound DHT records: only the holder of a peer id's private key can write records under that id.

Every corolla DHT node (client, server, bootstrap peer, monitor) installs `SignedRecordValidator`; hivemind calls
`validate` on every record another peer asks it to store and on every record a peer returns to a lookup, `sign_value`
on every record this node stores. The validator sees a record's key as its DHTID (a hash), so it cannot tell
corolla's keys apart; corolla's DHT holds nothing but corolla records, so one rule holds for all of them:

1. A record has a subkey. Plain values (hivemind's IS_REGULAR_VALUE) are refused: one with a later expiration would
   replace the whole dictionary of a key, every server record under it included.
2. The subkey is a peer id (a base58 string, msgpack-encoded the canonical way) and the value is an envelope
   carrying that peer's signature, under the label RECORD_LABEL, over (key, subkey, value, expiration time). So
   nobody can write, change, or re-date a record under another peer's id: to erase or hijack a server's record one
   would have to sign for its peer id. Ed25519 peer ids contain their public key; an RSA signer sends its public
   key along in the envelope, and it must hash to the peer id.
3. The envelope is at most MAX_RECORD_BYTES long, the expiration a finite number, the key a 20-byte DHTID.

A node signs only records whose subkey is its own peer id; any other record leaves it unsigned, and every node
(itself included) refuses it.

Replays: hivemind keeps, per (key, subkey), the record with the latest expiration; the expiration is signed, so a
replayed older record never replaces a newer one (the storage side is in dht.record_storage, which also refuses
records dated too far ahead: that rule depends on the clock, and a rule that depends on the clock must not run here,
see below).

Why every rule here is independent of time and of the node's state: hivemind validates a dictionary returned by a
peer as a whole, and refuses it whole when one record fails. A record that one node accepted when it was stored
but another refuses when it reads it would make every answer holding it worthless: any writer could hide every
other record under a key. Encodings are therefore checked to be canonical, since the reader re-encodes subkeys.

Envelope layout (bytes):  b"crs1" | u16 signature length | signature | u16 public key length | public key | value
Signed payload:           key (20) | u16 subkey length | subkey (UTF-8) | u32 value length | value | f64 expiration
"""

from __future__ import annotations

import hashlib
import logging
import math
import struct
from collections import OrderedDict

from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer

from corolla.protocol.signing import MAX_PUBLIC_KEY_BYTES, MAX_SIGNATURE_BYTES, PeerKey, embedded_public_key, verify

logger = logging.getLogger(__name__)

RECORD_LABEL = "corolla/dht-record/v1"
MAGIC = b"crs1"
MAX_RECORD_BYTES = 4096  # a signed record's value, envelope included (a ServerInfo takes ~0.5-2 KiB)
MAX_PEER_ID_CHARS = 128
VERIFIED_CACHE_SIZE = 32768  # records whose signature was checked already (a re-read costs a hash, not a verify)
_BASE58 = frozenset("123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz")
_HEADER = struct.Struct(">H")


def signed_payload(key: bytes, peer_id: str, value: bytes, expiration_time: float) -> bytes:
    """What a record's signature covers (see the module docstring)."""
    subkey = peer_id.encode()
    return b"".join((key, _HEADER.pack(len(subkey)), subkey, struct.pack(">I", len(value)), value,
                     struct.pack(">d", expiration_time)))


def seal(key: PeerKey, record_key: bytes, value: bytes, expiration_time: float) -> bytes:
    """The envelope of `value` stored under (record_key, key.peer_id) until `expiration_time`, signed by `key`."""
    signature = key.sign(RECORD_LABEL, signed_payload(record_key, key.peer_id, value, expiration_time))
    public_key = b"" if key.is_inline else key.public_key
    return b"".join((MAGIC, _HEADER.pack(len(signature)), signature, _HEADER.pack(len(public_key)), public_key, value))


def open_envelope(envelope: bytes) -> tuple[bytes, bytes, bytes] | None:
    """(signature, public key or b"", value) of an envelope; None when it is not one."""
    if not isinstance(envelope, bytes) or len(envelope) > MAX_RECORD_BYTES or not envelope.startswith(MAGIC):
        return None
    offset = len(MAGIC)
    parts = []
    for limit in (MAX_SIGNATURE_BYTES, MAX_PUBLIC_KEY_BYTES):
        if len(envelope) < offset + _HEADER.size:
            return None
        (length,) = _HEADER.unpack_from(envelope, offset)
        offset += _HEADER.size
        if length > limit or len(envelope) < offset + length:
            return None
        parts.append(envelope[offset : offset + length])
        offset += length
    return parts[0], parts[1], envelope[offset:]


def subkey_peer_id(subkey: bytes) -> str | None:
    """The peer id a record's subkey bytes name, or None unless they are the canonical msgpack of a peer id string."""
    if not isinstance(subkey, bytes) or not subkey or len(subkey) > MAX_PEER_ID_CHARS + 3:
        return None
    try:
        peer_id = MSGPackSerializer.loads(subkey)
    except Exception:  # msgpack raises assorted types for garbage
        return None
    if (not isinstance(peer_id, str) or not 0 < len(peer_id) <= MAX_PEER_ID_CHARS or not _BASE58.issuperset(peer_id)
            or MSGPackSerializer.dumps(peer_id) != subkey):
        return None
    return peer_id


class SignedRecordValidator(RecordValidatorBase):
    """hivemind RecordValidatorBase enforcing the rules of the module docstring; signs this node's own records."""

    def __init__(self, key: PeerKey):
        self.key = key
        self._own_subkey = MSGPackSerializer.dumps(key.peer_id)
        self._verified: OrderedDict[bytes, None] = OrderedDict()  # digests of records already verified
        self.refused = 0  # records refused so far (for logs and tests)

    def sign_value(self, record: DHTRecord) -> bytes:
        """The envelope of `record.value` when the subkey is our peer id; otherwise the value unchanged (so every node
        refuses it)."""
        if record.subkey != self._own_subkey or len(record.key) != DHTID.HASH_NBYTES:
            logger.debug("not signing a record under another subkey than our peer id")
            return record.value
        return seal(self.key, record.key, record.value, float(record.expiration_time))

    def strip_value(self, record: DHTRecord) -> bytes:
        """The value inside the envelope (hivemind calls this only for records that validated)."""
        opened = open_envelope(record.value)
        return record.value if opened is None else opened[2]

    def validate(self, record: DHTRecord) -> bool:
        """Whether `record` obeys rules 1-3 of the module docstring. Never raises."""
        ok = self._check(record)
        if not ok:
            self.refused += 1
        return ok

    def _check(self, record: DHTRecord) -> bool:
        if record.subkey == DHTProtocol.IS_REGULAR_VALUE:
            logger.debug("refusing a plain DHT value (corolla records have subkeys)")
            return False
        expiration = record.expiration_time
        if (not isinstance(record.key, bytes) or len(record.key) != DHTID.HASH_NBYTES or isinstance(expiration, bool)
                or not isinstance(expiration, (int, float)) or not math.isfinite(expiration)):
            return False
        expiration = float(expiration)
        peer_id = subkey_peer_id(record.subkey)
        opened = open_envelope(record.value)
        if peer_id is None or opened is None:
            logger.debug("refusing a DHT record whose subkey is no peer id or whose value is not signed")
            return False
        signature, public_key, value = opened
        if public_key and embedded_public_key(peer_id) is not None:
            return False  # one encoding per record: a key inlined in the peer id is never sent along
        digest = hashlib.sha256(b"".join((record.key, record.subkey, struct.pack(">d", expiration),
                                          record.value))).digest()
        if digest in self._verified:
            self._verified.move_to_end(digest)
            return True
        payload = signed_payload(record.key, peer_id, value, expiration)
        if not verify(peer_id, RECORD_LABEL, payload, signature, public_key or None):
            logger.debug("refusing a DHT record not signed by its subkey's peer %s", peer_id)
            return False
        self._verified[digest] = None
        if len(self._verified) > VERIFIED_CACHE_SIZE:
            self._verified.popitem(last=False)
        return True

    @property
    def priority(self) -> int:
        return 10  # like hivemind's signature validator: first to check, last to sign

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False
