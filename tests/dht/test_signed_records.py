"""Signed, owner-bound DHT records (dht.signed_records) and what a node keeps (dht.record_storage): exact verdicts
on hand-made records, replays and clocks, and the measured cost of signing and checking one record."""

from __future__ import annotations

import dataclasses
import time

import pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.proto import crypto_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer

from corolla.dht.record_storage import MAX_RECORD_AHEAD, RecordStorage, acceptable_expiration
from corolla.dht.signed_records import (MAX_RECORD_BYTES, SignedRecordValidator, open_envelope, seal,
                                        subkey_peer_id)
from corolla.protocol.signing import PeerKey

KEY = DHTID.generate(source="m.0")
VALUE = MSGPackSerializer.dumps({"state": "online", "start_block": 0})


def record(key: PeerKey, value: bytes = VALUE, expiration: float = 1000.5, subkey: str | None = None,
           record_key: DHTID = KEY) -> DHTRecord:
    """What hivemind hands the validator for a record `key` stores (under its own peer id unless `subkey`)."""
    subkey_bytes = MSGPackSerializer.dumps(subkey if subkey is not None else key.peer_id)
    unsigned = DHTRecord(record_key.to_bytes(), subkey_bytes, value, expiration)
    return dataclasses.replace(unsigned, value=SignedRecordValidator(key).sign_value(unsigned))


def rsa_key() -> PeerKey:
    data = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes()).SerializeToString()
    return PeerKey.from_identity(data)


# ---------------------------------------------------------------- the validator
def test_a_record_signed_by_its_subkeys_peer_validates_and_strips_to_its_value():
    owner, reader = PeerKey.generate(), SignedRecordValidator(PeerKey.generate())
    signed = record(owner)
    assert signed.value != VALUE and reader.validate(signed)
    assert reader.strip_value(signed) == VALUE


def test_an_rsa_signer_sends_its_public_key_and_validates_too():
    owner = rsa_key()
    signed = record(owner)
    signature, public_key, value = open_envelope(signed.value)
    assert public_key == owner.public_key and value == VALUE
    assert SignedRecordValidator(PeerKey.generate()).validate(signed)


def test_a_node_signs_only_under_its_own_peer_id():
    me, victim = PeerKey.generate(), PeerKey.generate()
    unsigned = DHTRecord(KEY.to_bytes(), MSGPackSerializer.dumps(victim.peer_id), VALUE, 1000.5)
    assert SignedRecordValidator(me).sign_value(unsigned) == VALUE  # left unsigned...
    assert not SignedRecordValidator(me).validate(unsigned)  # ...so every node refuses it, the writer included


def test_a_record_signed_by_another_peer_than_its_subkey_is_refused():
    attacker, victim = PeerKey.generate(), PeerKey.generate()
    envelope = seal(attacker, KEY.to_bytes(), VALUE, 1000.5)  # the attacker's valid signature...
    forged = DHTRecord(KEY.to_bytes(), MSGPackSerializer.dumps(victim.peer_id), envelope, 1000.5)  # ...under their id
    assert not SignedRecordValidator(PeerKey.generate()).validate(forged)


def test_an_rsa_envelope_with_someone_elses_public_key_is_refused():
    owner, impostor = rsa_key(), rsa_key()
    signed = record(impostor)
    as_owner = DHTRecord(signed.key, MSGPackSerializer.dumps(owner.peer_id), signed.value, signed.expiration_time)
    assert not SignedRecordValidator(PeerKey.generate()).validate(as_owner)


@pytest.mark.parametrize("change", ["value", "expiration", "key", "signature", "subkey"])
def test_changing_any_signed_part_invalidates_the_record(change):
    owner, other = PeerKey.generate(), PeerKey.generate()
    signed = record(owner)
    signature, _, value = open_envelope(signed.value)
    tampered = {
        "value": dataclasses.replace(signed, value=signed.value[:-1] + bytes([signed.value[-1] ^ 1])),
        "expiration": dataclasses.replace(signed, expiration_time=signed.expiration_time + 3600),
        "key": dataclasses.replace(signed, key=DHTID.generate(source="m.1").to_bytes()),
        "signature": dataclasses.replace(signed, value=signed.value.replace(signature, bytes(64))),
        "subkey": dataclasses.replace(signed, subkey=MSGPackSerializer.dumps(other.peer_id)),
    }[change]
    assert not SignedRecordValidator(PeerKey.generate()).validate(tampered)


def test_plain_values_and_malformed_records_are_refused():
    validator, owner = SignedRecordValidator(PeerKey.generate()), PeerKey.generate()
    signed = record(owner)
    refused = [
        DHTRecord(KEY.to_bytes(), DHTProtocol.IS_REGULAR_VALUE, signed.value, 1000.5),  # no subkey
        dataclasses.replace(signed, subkey=MSGPackSerializer.dumps(7)),  # a subkey that is no peer id
        dataclasses.replace(signed, subkey=MSGPackSerializer.dumps("not base58 0OIl")),
        dataclasses.replace(signed, subkey=b"\xda\x00" + bytes([len(owner.peer_id)]) + owner.peer_id.encode()),  # str16
        dataclasses.replace(signed, value=VALUE),  # no envelope
        dataclasses.replace(signed, value=signed.value + b"x" * MAX_RECORD_BYTES),  # too long
        dataclasses.replace(signed, value=signed.value[:20]),  # cut short
        dataclasses.replace(signed, key=b"\x00" + signed.key),  # a non-canonical key
        dataclasses.replace(signed, expiration_time=float("nan")),
        dataclasses.replace(signed, expiration_time=float("inf")),
    ]
    assert [validator.validate(r) for r in refused] == [False] * len(refused)
    assert validator.refused == len(refused)
    assert subkey_peer_id(MSGPackSerializer.dumps(owner.peer_id)) == owner.peer_id


def test_validity_does_not_depend_on_the_clock():
    """A record one node kept must validate at every reader, or it would poison every answer holding it: the
    validator accepts a record expiring a year ahead (storage refuses it) and one that expired (storage drops it)."""
    validator, owner = SignedRecordValidator(PeerKey.generate()), PeerKey.generate()
    assert validator.validate(record(owner, expiration=get_dht_time() + 365 * 86400))
    assert validator.validate(record(owner, expiration=1.0))


def test_a_whole_dictionary_from_a_peer_is_refused_when_one_record_is_forged():
    """hivemind checks dictionaries (passed on between nodes, and in lookup answers) record by record."""
    protocol = DHTProtocol.__new__(DHTProtocol)  # only the validation helper is used
    protocol.record_validator, protocol.serializer = SignedRecordValidator(PeerKey.generate()), MSGPackSerializer
    honest, attacker, victim = PeerKey.generate(), PeerKey.generate(), PeerKey.generate()
    expiration = get_dht_time() + 60
    dictionary = DictionaryDHTValue()
    dictionary.store(honest.peer_id, record(honest, expiration=expiration).value, expiration)
    assert len(dictionary) == 1 and protocol._validate_dictionary(KEY.to_bytes(), dictionary)
    dictionary.store(victim.peer_id, seal(attacker, KEY.to_bytes(), VALUE, expiration), expiration)
    assert len(dictionary) == 2 and not protocol._validate_dictionary(KEY.to_bytes(), dictionary)


def test_signing_and_checking_a_record_costs_microseconds(capsys):
    owner, validator = PeerKey.generate(), SignedRecordValidator(PeerKey.generate())
    value = MSGPackSerializer.dumps({"x": "y" * 600})  # about a ServerInfo
    n = 200
    begin = time.perf_counter()
    records = [record(owner, value, 1000.5 + i) for i in range(n)]
    signed = time.perf_counter()
    assert all(validator.validate(r) for r in records)
    checked = time.perf_counter()
    assert all(validator.validate(r) for r in records)  # again: the digest of each is remembered
    again = time.perf_counter()
    with capsys.disabled():
        print(f"\nsign {1e6 * (signed - begin) / n:.0f} us, first check {1e6 * (checked - signed) / n:.0f} us, "
              f"check again {1e6 * (again - checked) / n:.1f} us per record")
    assert (again - checked) < (checked - signed)


# ---------------------------------------------------------------- the storage
def test_storage_refuses_plain_values_and_far_or_past_expirations():
    storage, now = RecordStorage(), get_dht_time()
    assert not storage.store(KEY, b"plain", now + 60)
    assert not storage.store(KEY, b"v", now + MAX_RECORD_AHEAD + 60, subkey="12D3KooWA")
    assert not storage.store(KEY, b"v", now - 1, subkey="12D3KooWA")
    assert storage.store(KEY, b"v", now + 3600, subkey="12D3KooWA")
    assert storage.refused == 3
    assert acceptable_expiration(now + 10, now) and not acceptable_expiration(float("inf"), now)


def test_a_replayed_older_record_neither_replaces_nor_cuts_short_the_newer_one(monkeypatch):
    """hivemind's own storage re-points its expiry heap at a refused older record, so the newer record vanishes when
    the replay expires; RecordStorage keeps the newer one until its own expiration."""
    clock = [1000.0]
    monkeypatch.setattr("hivemind.utils.timed_storage.get_dht_time", lambda: clock[0])
    monkeypatch.setattr("corolla.dht.record_storage.get_dht_time", lambda: clock[0])
    for storage, survives in ((DHTLocalStorage(), False), (RecordStorage(), True)):
        clock[0] = 1000.0
        assert storage.store(KEY, b"newer", 1090.0, subkey="12D3KooWA")
        assert not storage.store(KEY, b"older", 1010.0, subkey="12D3KooWA")  # the replay is refused...
        clock[0] = 1011.0
        held = storage.get(KEY)
        kept = held is not None and held.value.get("12D3KooWA") is not None
        assert kept == survives  # ...but only RecordStorage still holds the newer record after it expires
        if survives:
            assert held.value.get("12D3KooWA").value == b"newer"


def test_storage_keeps_at_most_max_subkeys_writers_while_they_can_refresh():
    storage, now = RecordStorage(max_subkeys=3), get_dht_time()
    assert all(storage.store(KEY, b"v", now + 60, subkey=f"12D3KooW{i}") for i in range(3))
    assert not storage.store(KEY, b"v", now + 60, subkey="12D3KooWnew")
    assert storage.store(KEY, b"refreshed", now + 90, subkey="12D3KooW1")
    assert sorted(storage.get(KEY).value.data) == ["12D3KooW0", "12D3KooW1", "12D3KooW2"]
