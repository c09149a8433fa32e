"""What one answer to a lookup may cost (dht.lookup): an answer holding more records under a key than an honest node
keeps is dropped from its headers alone, before any record is decoded or any signature checked."""

from __future__ import annotations

from types import SimpleNamespace

from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from corolla.dht.lookup import _bounded_dictionary, _records_in
from corolla.dht.lookup import MAX_ANSWER_RECORDS


class CountingValidator:
    def __init__(self) -> None:
        self.calls = 0

    def validate(self, record) -> bool:
        self.calls += 1
        return True


def answer(records: int) -> bytes:
    dictionary = DictionaryDHTValue()
    for i in range(records):
        dictionary.store(f"12D3KooW{i}", b"v", get_dht_time() + 60)
    return MSGPackSerializer.dumps(dictionary)


def test_the_records_of_an_answer_are_counted_from_its_headers():
    assert [_records_in(answer(n)) for n in (0, 3, 300)] == [0, 3, 300]
    assert _records_in(b"garbage") > MAX_ANSWER_RECORDS
    assert _records_in(MSGPackSerializer.dumps([1, 2, 3])) > MAX_ANSWER_RECORDS


def test_an_answer_over_the_bound_is_dropped_before_any_record_is_checked():
    validator = CountingValidator()
    dht = SimpleNamespace(protocol=SimpleNamespace(record_validator=validator))
    key = DHTID.generate(source="m.0")
    assert _bounded_dictionary(dht, key, answer(MAX_ANSWER_RECORDS + 1), "peer") is None
    assert validator.calls == 0
    kept = _bounded_dictionary(dht, key, answer(MAX_ANSWER_RECORDS), "peer")
    assert isinstance(kept, DictionaryDHTValue) and len(kept) == MAX_ANSWER_RECORDS
    assert validator.calls == MAX_ANSWER_RECORDS
