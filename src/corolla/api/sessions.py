"""Finished sessions kept open for prefix reuse: which one a new prompt continues, which ones to give up.

A chat client sends the whole conversation every turn. The session that generated the previous reply still
holds that conversation's tokens in the servers' KV caches, so the follow-up rolls it back to the longest prefix
it shares with the new prompt and sends only the rest (a re-tokenized reply may differ from the sampled tokens
near its end: the rollback covers that). Kept sessions are bounded in count and in age, and the engine gives
them up whenever a server is too full to open a new session.

Every kept session belongs to an owner (the API key that generated it; one shared owner when the API has no
keys): a prompt only ever continues its own owner's sessions, so a caller can neither continue another key's
conversation nor learn, from a faster answer or from `cached_tokens`, that another key's prefix is held. When a
session must be given up (the count is reached, or a server is full), it is the oldest session of the owner
holding the most: one key filling the pool gives up its own sessions before anyone else's, and an owner holding
no more than any other keeps them.

Pure bookkeeping, no I/O: every method returns the sessions the caller must close.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Sequence, TypeVar

S = TypeVar("S")


@dataclass
class _Kept(Generic[S]):
    session: S
    ids: list[int]  # the tokens the servers hold for it, positions [0, len(ids))
    capacity: int  # the session's max_length: the most tokens it can ever hold
    since: float  # when it was kept (monotonic seconds)
    owner: str  # the API key (its id) whose request generated it; "" without keys


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading tokens a and b share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class IdleSessions(Generic[S]):
    """At most `max_count` kept sessions, each for at most `ttl` seconds, continued when `min_reuse` tokens match
    and only by their own owner."""

    def __init__(self, max_count: int, ttl: float, min_reuse: int):
        self.max_count = max_count
        self.ttl = ttl
        self.min_reuse = max(1, min_reuse)
        self._kept: list[_Kept[S]] = []  # oldest first

    def __len__(self) -> int:
        return len(self._kept)

    def held_by(self, owner: str) -> int:
        """Number of sessions kept for `owner`."""
        return sum(1 for k in self._kept if k.owner == owner)

    def put(self, session: S, ids: Sequence[int], capacity: int, now: float, owner: str = "") -> list[S]:
        """Keep a finished session of `owner` holding `ids`; returns the sessions given up to stay within max_count
        (each the oldest of the owner then holding the most, or this one itself when max_count is 0)."""
        if self.max_count <= 0:
            return [session]
        self._kept.append(_Kept(session, list(ids), capacity, now, owner))
        dropped = []
        while len(self._kept) > self.max_count:
            dropped.append(self._pop_victim())
        return dropped

    def take(self, prompt: Sequence[int], length: int, now: float, owner: str = "") -> tuple[S, int] | None:
        """`owner`'s kept session sharing the longest prefix with `prompt` (at least min_reuse tokens) that can hold
        `length` tokens, removed from the pool, with the number of prompt tokens it keeps (always fewer than the
        prompt's length, so that the next step has a token to compute). None when no session fits; another
        owner's sessions are never looked at."""
        best: tuple[int, int] | None = None  # (reused tokens, index)
        for index, kept in enumerate(self._kept):
            if kept.owner != owner or kept.capacity < length or now - kept.since > self.ttl:
                continue
            reused = min(common_prefix(kept.ids, prompt), len(prompt) - 1)
            if reused >= self.min_reuse and (best is None or reused >= best[0]):
                best = (reused, index)
        if best is None:
            return None
        kept = self._kept.pop(best[1])
        return kept.session, best[0]

    def expired(self, now: float) -> list[S]:
        """Removes and returns the sessions kept longer than ttl."""
        old = [k for k in self._kept if now - k.since > self.ttl]
        self._kept = [k for k in self._kept if now - k.since <= self.ttl]
        return [k.session for k in old]

    def next_expiry(self) -> float | None:
        """When the oldest kept session expires (monotonic seconds), or None when none is kept."""
        return self._kept[0].since + self.ttl if self._kept else None

    def give_up_one(self) -> S | None:
        """Remove and return the session to give up when a server is full: the oldest of the owner holding the
        most; None when none is kept."""
        return self._pop_victim() if self._kept else None

    def drain(self) -> list[S]:
        sessions = [k.session for k in self._kept]
        self._kept.clear()
        return sessions

    def _pop_victim(self) -> S:
        held: dict[str, int] = {}
        for k in self._kept:
            held[k.owner] = held.get(k.owner, 0) + 1
        most = max(held.values())
        index = next(i for i, k in enumerate(self._kept) if held[k.owner] == most)  # oldest first
        return self._kept.pop(index).session
