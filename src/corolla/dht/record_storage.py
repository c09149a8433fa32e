"""What an honest corolla DHT node agrees to keep: `RecordStorage` replaces hivemind's local storage and cache.

Records reach it only after dht.signed_records validated them (signatures, owners, encodings); the rules here are
the ones that depend on the clock or on what the node holds already, which a validator must not apply (a record
refused by a reader but kept by its storer would poison every answer holding it, see dht.signed_records):

- no plain values: a key holds a dictionary of signed records, one per subkey (writer);
- an expiration at most MAX_RECORD_AHEAD seconds (1 h plus clock skew) past now: nobody pins a record for a year;
- per (key, subkey) the record with the latest expiration wins, and an older one is refused *without touching* the
  newer one. (hivemind's TimedStorage re-points its expiry heap at the refused record, so a replayed record that
  expires in a second would have erased the current record a second later.)
- at most MAX_SUBKEYS_PER_KEY writers per key: a flood of records under fresh peer ids cannot grow one key without
  bound (the first writers keep their place while they refresh; new ones wait for a slot).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.utils import get_dht_time

logger = logging.getLogger(__name__)

MAX_RECORD_LIFETIME = 3600.0  # seconds: the longest a record may be stored for
MAX_CLOCK_SKEW = 300.0  # seconds the writer's clock may be ahead of ours
MAX_RECORD_AHEAD = MAX_RECORD_LIFETIME + MAX_CLOCK_SKEW
MAX_SUBKEYS_PER_KEY = 256  # writers kept under one key (servers of one block; servers announcing models)
CACHE_KEYS = 4096  # keys the node caches for others (hivemind's default is unbounded)


def acceptable_expiration(expiration_time: float, now: float) -> bool:
    """Whether a record expiring at `expiration_time` may be stored at DHT time `now`: finite, later than now, and
    at most MAX_RECORD_AHEAD ahead."""
    return math.isfinite(expiration_time) and now <= expiration_time <= now + MAX_RECORD_AHEAD


class RecordStorage(DHTLocalStorage):
    """hivemind's DHTLocalStorage with the rules of the module docstring; `refused` counts refused records."""

    def __init__(self, maxsize: int | None = None, max_subkeys: int = MAX_SUBKEYS_PER_KEY):
        super().__init__(maxsize=maxsize)
        self.max_subkeys = max_subkeys
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
        if not isinstance(expiration_time, (int, float)) or not acceptable_expiration(expiration_time, get_dht_time()):
            logger.debug("refusing a record expiring %s s from now", expiration_time - get_dht_time()
                         if isinstance(expiration_time, (int, float)) else expiration_time)
            self.refused += 1
            return False
        current = self.get(key)
        if current is not None and isinstance(current.value, DictionaryDHTValue):
            dictionary = current.value
            held = dictionary.get(subkey)
            if held is not None and held.expiration_time >= expiration_time:
                return False  # an older (or the same) record: the newer one stays, and so does its expiry
            if held is None and len(dictionary) >= self.max_subkeys:
                logger.debug("refusing a new writer under a key that holds %d already", len(dictionary))
                self.refused += 1
                return False
        elif current is not None:  # a plain value from before (never stored by this class): replaced
            del self[key]
        return super().store_subkey(key, subkey, value, expiration_time)


def adopt(old: DHTLocalStorage, new: RecordStorage) -> None:
    """Move what `old` holds into `new` (by its rules): records other peers stored while the node was starting."""
    for key, item in list(old.items()):
        new.store(key, item.value, item.expiration_time)
