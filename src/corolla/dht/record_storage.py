"""What an honest corolla DHT node agrees to keep: `RecordStorage` replaces hivemind's local storage and cache.

Records reach it only after dht.signed_records validated them (signatures, owners, encodings); the rules here are
the ones that depend on the clock, on who sent the record, or on what the node holds already, which a validator must
not apply (a record refused by a reader but kept by its storer would poison every answer holding it, see
dht.signed_records):

- no plain values: a key holds a dictionary of signed records, one per subkey (writer);
- an expiration at most MAX_RECORD_AHEAD seconds (1 h plus clock skew) past now: nobody pins a record for a year;
- per (key, subkey) the record with the latest expiration wins, and an older one is refused *without touching* the
  newer one. (hivemind's TimedStorage re-points its expiry heap at the refused record, so a replayed record that
  expires in a second would have erased the current record a second later.)
- a record is stored only when its own writer sends it (the store request comes from the peer id of its subkey):
  one peer cannot store records signed by a thousand fresh keys, each identity has to connect and store for itself.
  (hivemind also hands a node's records to a new neighbour; that copy is refused, and the writers' next refresh
  stores them there.) The cache takes nothing from other peers: corolla's lookups ask the storing nodes themselves
  (dht.lookup), and an answer is made from the storage alone, so nobody can answer for a key through a node's cache;
- at most MAX_SUBKEYS_PER_KEY writers per key, admitted and answered by rank (dht.admission, with the writers' checks
  of dht.verifier): a flood of fresh identities neither keeps a real server out of a key nor pushes it out, and an
  answer holds at most admission.ANSWER_RECORDS records per key however many servers a block has.

`install` (dht.node) binds each store request's sender and each lookup answer to these rules, by wrapping the DHT's
unary handlers (their contexts are `STORE_SENDER` and `ANSWERING`).
"""

from __future__ import annotations

import hashlib
import logging
import math
from contextvars import ContextVar
from typing import Any, Protocol

from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.utils import ValueWithExpiration, get_dht_time

from corolla.dht.admission import ANSWER_RECORDS, UNKNOWN, Held, answer_order, evict_for
from corolla.dht.signed_records import open_envelope

logger = logging.getLogger(__name__)

# the peer id a store request came from (None: the node itself), and whether a lookup is being answered
STORE_SENDER: ContextVar[str | None] = ContextVar("corolla_store_sender", default=None)
ANSWERING: ContextVar[bool] = ContextVar("corolla_answering", default=False)


class Ranks(Protocol):
    """What admission needs of a node's checks of writers (dht.verifier.RecordVerifier)."""

    def rank(self, peer: str, key: DHTID) -> int: ...

    def request(self, peer: str) -> None: ...

MAX_RECORD_LIFETIME = 3600.0  # seconds: the longest a record may be stored for
MAX_CLOCK_SKEW = 300.0  # seconds the writer's clock may be ahead of ours
MAX_RECORD_AHEAD = MAX_RECORD_LIFETIME + MAX_CLOCK_SKEW
MAX_SUBKEYS_PER_KEY = 1024  # writers kept under one key (servers of one block; servers announcing models)
CACHE_KEYS = 4096  # keys the node caches for others (hivemind's default is unbounded)


def acceptable_expiration(expiration_time: float, now: float) -> bool:
    """Whether a record expiring at `expiration_time` may be stored at DHT time `now`: finite, later than now, and
    at most MAX_RECORD_AHEAD ahead."""
    return math.isfinite(expiration_time) and now <= expiration_time <= now + MAX_RECORD_AHEAD


class RecordStorage(DHTLocalStorage):
    """hivemind's DHTLocalStorage with the rules of the module docstring; `refused` counts refused records. As a
    `cache`, it takes records from this node only."""

    def __init__(self, maxsize: int | None = None, max_subkeys: int = MAX_SUBKEYS_PER_KEY,
                 ranks: Ranks | None = None, cache: bool = False, answer_records: int = ANSWER_RECORDS):
        super().__init__(maxsize=maxsize)
        self.max_subkeys = max_subkeys
        self.ranks = ranks  # the node's checks of writers (None: every record UNKNOWN)
        self.cache = cache
        self.answer_records = answer_records
        self.refused = 0

    def store(self, key: DHTID, value: Any, expiration_time: float, subkey: Any = None) -> bool:
        if subkey is not None:
            return self.store_subkey(key, subkey, value, expiration_time)
        if isinstance(value, DictionaryDHTValue):  # a whole dictionary (hivemind's cache of a lookup): one by one
            results = [self.store_subkey(key, s, item.value, item.expiration_time) for s, item in value.items()]
            return bool(results) and all(results)
        self.refused += 1
        return False

    def store_subkey(self, key: DHTID, subkey: Any, value: bytes, expiration_time: float) -> bool:
        sender = STORE_SENDER.get()
        if sender is not None and (self.cache or sender != subkey):
            logger.debug("refusing a record of %s sent by %s%s", subkey, sender, " into the cache" if self.cache else "")
            self.refused += 1
            return False
        if not isinstance(expiration_time, (int, float)) or not acceptable_expiration(expiration_time, get_dht_time()):
            logger.debug("refusing a record expiring %s s from now", expiration_time - get_dht_time()
                         if isinstance(expiration_time, (int, float)) else expiration_time)
            self.refused += 1
            return False
        current = super().get(key)
        if current is not None and isinstance(current.value, DictionaryDHTValue):
            dictionary = current.value
            held = dictionary.get(subkey)
            if held is not None and held.expiration_time >= expiration_time:
                return False  # an older (or the same) record: the newer one stays, and so does its expiry
            if held is None and len(dictionary) >= self.max_subkeys and not self._make_room(key, dictionary, subkey,
                                                                                            value, expiration_time):
                self.refused += 1
                return False
        elif current is not None:  # a plain value from before (never stored by this class): replaced
            del self[key]
        stored = super().store_subkey(key, subkey, value, expiration_time)
        if stored and sender is not None and self.ranks is not None:
            self.ranks.request(subkey)
        return stored

    def _make_room(self, key: DHTID, dictionary: DictionaryDHTValue, subkey: str, value: bytes,
                   expiration_time: float) -> bool:
        """Evict the incumbent a new writer takes the place of (dht.admission.evict_for); False if it is refused (its
        writer and the incumbents not checked yet are checked then, for its next refresh)."""
        held = self._held(key, dictionary)
        newcomer = self._describe(key, subkey, value, expiration_time)
        victim = evict_for(held, newcomer, self.max_subkeys)
        if isinstance(victim, Held):
            logger.debug("key full: %s (rank %d) gives way to %s (rank %d)", victim.subkey, victim.rank, subkey,
                         newcomer.rank)
            del dictionary[victim.subkey]
            return True
        if victim is None and self.ranks is not None:
            self.ranks.request(subkey)
            for record in held:
                if record.rank == UNKNOWN:
                    self.ranks.request(record.subkey)
        logger.debug("refusing a new writer under a key that holds %d already", len(dictionary))
        return victim is True

    def _describe(self, key: DHTID, subkey: Any, value: bytes, expiration: float) -> Held:
        rank = UNKNOWN if self.ranks is None or not isinstance(subkey, str) else self.ranks.rank(subkey, key)
        opened = open_envelope(value)
        group = hashlib.blake2b(opened[2] if opened is not None else value, digest_size=8).digest()
        return Held(str(subkey), rank, group, float(expiration))

    def _held(self, key: DHTID, dictionary: DictionaryDHTValue) -> list[Held]:
        with dictionary.freeze():
            return [self._describe(key, s, item.value, item.expiration_time) for s, item in dictionary.items()]

    def get(self, key: DHTID) -> ValueWithExpiration | None:
        """What the node holds under `key`; while a lookup is answered (`ANSWERING`), the storage's records chosen by
        dht.admission.answer_order (at most `answer_records`), and nothing from the cache."""
        found = super().get(key)
        if not ANSWERING.get() or found is None:
            return found
        if self.cache:
            return None
        dictionary = found.value
        if not isinstance(dictionary, DictionaryDHTValue) or len(dictionary) <= self.answer_records:
            return found
        chosen = set(answer_order(self._held(key, dictionary), self.answer_records))
        answer = DictionaryDHTValue()
        with dictionary.freeze():
            for subkey, item in dictionary.items():
                if str(subkey) in chosen:
                    answer.store(subkey, item.value, item.expiration_time)
        return ValueWithExpiration(answer, found.expiration_time)


def adopt(old: DHTLocalStorage, new: RecordStorage) -> None:
    """Move what `old` holds into `new` (by its rules): records other peers stored while the node was starting."""
    for key, item in list(old.items()):
        new.store(key, item.value, item.expiration_time)
