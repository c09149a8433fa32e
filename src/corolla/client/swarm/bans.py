"""Bans and retry backoff, as pure arithmetic over plain data (no clock, no I/O): the client's sequence manager
applies them with its monotonic clock, and the swarm simulator (corolla.sim) with its simulated one.

A peer that failed is banned for `min_backoff` seconds after its first failure, doubling with each further one up
to `max_backoff`; an unreachable peer (it could not even be dialed) for at least `unreachable_ban`; a success
forgets its failures. The k-th retry of one request waits `retry_delay(k)` seconds:

    failures so far   1     2     3     4     5 ...      (min_backoff 0.5 s, max_backoff 60 s)
    ban, seconds      0.5   1     2     4     8 ...  capped at 60
    retry waits, s    0     0.5   1     1.5   2 ...  capped at 5 (the first retry goes at once, to a replica)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

MAX_RETRY_DELAY = 5.0  # seconds: the longest a retry waits before it re-reads the swarm and tries again


@dataclass(frozen=True)
class Ban:
    """One peer's ban: avoided until `until` (seconds, on the caller's clock), after `failures` failures in a row;
    `unreachable`: it could not be dialed (skipped even when it is a block's only server)."""

    until: float
    failures: int
    unreachable: bool


def ban_seconds(failures: int, min_backoff: float, max_backoff: float, unreachable: bool = False,
                unreachable_ban: float = 0.0, at_least: float = 0.0) -> float:
    """How long a peer is banned after its `failures`-th failure in a row (>= 1): min_backoff x 2^(failures - 1),
    capped at max_backoff, at least `at_least`, and at least `unreachable_ban` when it could not be dialed."""
    if failures < 1:
        raise ValueError(f"a ban follows at least one failure, got failures={failures}")
    duration = max(at_least, min(max_backoff, min_backoff * 2 ** min(failures - 1, 62)))
    return max(duration, unreachable_ban) if unreachable else duration


def next_ban(previous: Ban | None, now: float, min_backoff: float, max_backoff: float, unreachable: bool = False,
             unreachable_ban: float = 0.0, at_least: float = 0.0) -> Ban:
    """The ban after one more failure at `now`, given the peer's `previous` ban (None: no failure on record)."""
    failures = previous.failures + 1 if previous is not None else 1
    duration = ban_seconds(failures, min_backoff, max_backoff, unreachable, unreachable_ban, at_least)
    return Ban(until=now + duration, failures=failures, unreachable=unreachable)


def banned_peers(bans: Mapping[str, Ban], now: float, unreachable_only: bool = False) -> set[str]:
    """The peers whose ban still holds at `now` (only those that could not be dialed, with `unreachable_only`)."""
    return {peer for peer, ban in bans.items() if ban.until > now and (ban.unreachable or not unreachable_only)}


def retry_delay(failures: int, min_backoff: float) -> float:
    """Seconds to wait before retrying a request that has failed `failures` times (>= 1): none before the first
    retry (it goes to another server at once), then min_backoff x (failures - 1), at most MAX_RETRY_DELAY."""
    return min(min_backoff * (failures - 1), MAX_RETRY_DELAY) if failures > 1 else 0.0
