"""The KV-cache queue's decisions, pure: which requests are refused at once, and which waiting ones are granted now.

First fit in arrival order, with an aging bound. A request may be granted when it fits in what is free and keeps
its peer within the per-peer limit (what one peer may hold at once). Scanning the queue oldest first, every such
request is granted; the scan stops at the first request that cannot be granted, has waited at least `patience`
seconds, and waits only on other peers (its own peer's holdings would let it in: it is *protected*):

    queue, oldest first:   A 900 tokens (waited 7 s)   B 100 (2 s)   C 50 (1 s)        free: 120 tokens
    patience 10 s  ->  A does not fit yet, B fits (20 left), C does not: grants [B]
    patience  5 s  ->  A is protected and does not fit: nothing behind it is granted: grants []

So one request that cannot fit yet does not block everyone behind it (head-of-line blocking: with a strict FIFO, a
peer holding 1 of 2,048 tokens and queueing a request for all 2,048 kept every other client out), and a large
request is not starved by a stream of small ones either: once protected, nothing that arrived after it is granted
until it fits or leaves (its allocation timeout bounds that). A request that could only be granted once its *own*
peer releases cache (that peer's holdings plus it pass the per-peer limit) is never protected: it waits for its own
peer without holding anyone else back; a client running many sessions (`corolla api`) queues behind its own.

A request larger than the per-peer limit could never be granted at all: it is refused at once, never queued.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CacheRequest:
    """One waiting reservation: `tokens` for `owner` (a session id), asked by `peer` at `arrived` (seconds)."""

    owner: str
    peer: str
    tokens: int
    arrived: float


def peer_limit(total: int, share: float) -> int:
    """The most cache tokens one peer may hold: `share` of the budget `total`, rounded down, at least 1."""
    return max(1, min(total, int(total * share)))


def refusal(tokens: int, total: int, limit: int) -> str | None:
    """Why a request for `tokens` could never be granted on a server of `total` tokens and per-peer `limit`, or None."""
    if tokens > total:
        return f"{tokens} cache tokens is more than this server's whole cache of {total}"
    if tokens > limit:
        return f"{tokens} cache tokens is more than one peer may hold here (per-peer limit: {limit} of {total} tokens)"
    return None


def grants(free: int, held: Mapping[str, int], limit: int, queue: Sequence[CacheRequest], now: float,
           patience: float) -> list[str]:
    """The owners to grant now, in grant order, out of `queue` (oldest first), with `free` tokens, `held[peer]`
    tokens held by each peer and a per-peer `limit` (see the module doc)."""
    holding = Counter(held)
    granted = []
    for request in queue:
        within_limit = holding[request.peer] + request.tokens <= limit
        if within_limit and request.tokens <= free:
            granted.append(request.owner)
            free -= request.tokens
            holding[request.peer] += request.tokens
        elif within_limit and now - request.arrived >= patience:
            break
    return granted
