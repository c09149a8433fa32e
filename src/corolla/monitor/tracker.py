"""What a monitor remembers between refreshes: since when each server answers, its last counters, which models had
a server answering, and which announcers of the model index did not answer lately (not asked again for a while)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Seen:
    since: float  # unix time it was first seen answering (without a gap since)
    at: float  # unix time of the last answer
    decode_steps: int


class PeerTracker:
    """Uptime as seen by this monitor, and decode steps/s from the difference of two answers.

    Pure bookkeeping on the times it is given; a server that misses one ping starts a new uptime, and a counter
    that went backwards (the server restarted) gives no rate for that refresh.
    """

    def __init__(self) -> None:
        self._seen: dict[str, _Seen] = {}
        self.live_models: set[str] = set()  # DHT prefixes with a server that answered at the last look
        self.silent: dict[str, float] = {}  # index announcer -> unix time it last failed to answer

    @property
    def known_peers(self) -> frozenset[str]:
        """Servers that answered at the last look (read and pinged first at the next)."""
        return frozenset(self._seen)

    def observe(
        self, peer_id: str, now: float, reachable: bool, decode_steps: int | None
    ) -> tuple[float | None, float | None]:
        """Record one refresh's result for `peer_id`; returns (uptime seconds, decode steps/s), None where unknown."""
        if not reachable:
            self._seen.pop(peer_id, None)
            return None, None
        steps = decode_steps or 0
        last = self._seen.get(peer_id)
        if last is None:
            self._seen[peer_id] = _Seen(since=now, at=now, decode_steps=steps)
            return 0.0, None
        rate = None
        if now > last.at and steps >= last.decode_steps:
            rate = (steps - last.decode_steps) / (now - last.at)
        last.at, last.decode_steps = now, steps
        return now - last.since, rate

    def silent_since(self, now: float, retry: float) -> set[str]:
        """Announcers that failed to answer within the last `retry` seconds (the others are forgotten)."""
        self.silent = {peer: t for peer, t in self.silent.items() if now - t < retry}
        return set(self.silent)

    def retain(self, peer_ids: set[str]) -> None:
        """Forget every server not in `peer_ids` (its record expired)."""
        for peer in list(self._seen):
            if peer not in peer_ids:
                del self._seen[peer]
