"""StreamQuota: how many streams each API key may have in the engine at once.

The engine has `max_streams` slots shared by every caller; a key whose request would bring its streams
(generating or waiting for a slot) past its limit is refused at once (HTTP 429) rather than queued, so one key
cannot take every slot and make every other key's requests wait behind its own. Pure counting, thread-safe:
requests take their streams on the HTTP loop, the engine gives them back on the client's loop as they end.
"""

from __future__ import annotations

import threading


class StreamQuota:
    """At most `limit` streams per owner (None: no limit)."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, owner: str, count: int) -> bool:
        """Count `count` more streams for `owner`, or nothing and False if that would pass the limit."""
        with self._lock:
            held = self._held.get(owner, 0)
            if self.limit is not None and held + count > self.limit:
                return False
            self._held[owner] = held + count
            return True

    def give_back(self, owner: str, count: int = 1) -> None:
        with self._lock:
            left = self._held.get(owner, 0) - count
            if left > 0:
                self._held[owner] = left
            else:
                self._held.pop(owner, None)

    def held(self, owner: str) -> int:
        with self._lock:
            return self._held.get(owner, 0)
